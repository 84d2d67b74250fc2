"""Training-run benchmarks: run `adacc train` with given flags in a child process and collect its summary.

Each method runs twice in its own process: once with the default allocator for time, once with a fixed mmap
threshold for memory (peak RSS under glibc's default malloc keeps freed buffers; docs/measuring.md). On CUDA
one run gives both (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import json
import re
import sys

from megatron_adacc.bench import harness

#: ``--attention``: the core attention every method of a bench runs with, as ``adacc train`` flags. The fused
#: kernel's CPU path has no dropout, so under ``sdpa`` every method (Megatron's too) trains without attention
#: dropout; ``config`` keeps the config's own.
ATTENTION_FLAGS: dict[str, list[str]] = {
    "config": [],
    "unfused": ["--attention-backend", "local"],
    "sdpa": ["--attention-backend", "flash", "--attention-dropout", "0"],
}


def attention_flags(args) -> list[str]:
    """The ``adacc train`` flags of the bench's ``--attention`` (none for a caller that does not say)."""
    return ATTENTION_FLAGS[getattr(args, "attention", None) or "config"]


def add_attention_argument(parser) -> None:
    """The bench's ``--attention``, whose flags (:data:`ATTENTION_FLAGS`) join every method's command line."""
    parser.add_argument("--attention", choices=tuple(ATTENTION_FLAGS), default="config",
                        help="Core attention of every method: the config's (default), megatron-core's unfused "
                             "DotProductAttention, or PyTorch's fused SDPA kernel (attention dropout 0 for all, "
                             "as its CPU kernel has none).")


def profile_for(flags: list[str], timeout: float = 1800) -> None:
    """Run `adacc profile` for this configuration in its own process, so that an ``--adacc-policy auto`` run
    afterwards reuses the stored profile and its peak memory does not include the profiling."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(harness.REPO_ROOT)}
    keep = [f for f in flags if not f.startswith("--adacc-policy") and f != "auto"]
    proc = subprocess.run([sys.executable, "-m", "megatron_adacc.cli", "profile", *keep], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"adacc profile failed:\n{proc.stderr[-3000:]}")


def peak_memory(flags: list[str], timeout: float = 1800) -> int:
    """Peak memory of one `adacc train` invocation, from a low-fragmentation run on CPU (no timing run)."""
    out = harness.run_method_subprocess(__name__, {"flags": flags}, timeout=timeout,
                                        low_fragmentation_malloc=True)
    return int(out["peak_memory_bytes"])


def keep_all_offset(flags: list[str], workdir) -> tuple[int, dict]:
    """What ``--adacc-policy auto`` on CPU should count as the process's own memory for this configuration:
    the measured peak of Adacc's keep-all policy minus the cost model's prediction for it without any
    process memory. Returns ``(offset bytes, profile reference)``. Runs the profiler (in a child) if needed.
    """
    from pathlib import Path

    from megatron_adacc.adacc.policy.io import save_policy
    from megatron_adacc.adacc.policy.policy import Policy
    from megatron_adacc.adacc.policy.profile_db import ProfileDB
    from megatron_adacc.adacc.policy.solver import evaluate_policy

    out = harness.run_method_subprocess("megatron_adacc.bench.budget", {"flags": flags}, timeout=3600)
    ref = out["ref"]
    profile = ProfileDB(ref["db"]).get_by_id(int(ref["id"]))
    layers = int(profile.signature["num_layers"])
    path = save_policy(Policy.all_keep(layers), Path(workdir) / f"keep_all_{abs(hash(tuple(flags)))}.json")
    measured = peak_memory(flags + ["--adacc-policy", str(path)])
    model = evaluate_policy(profile, Policy.all_keep(layers))["memory_bytes"]
    return int(measured - model), ref


def train_method(flags: list[str], memory_run: bool = True, timeout: float = 1800) -> dict:
    """Metrics of one `adacc train` invocation: step_time_s, tokens_per_s, final_loss, losses,
    saved_activation_bytes, peak_memory_bytes (from a low-fragmentation run when ``memory_run``)."""
    timed = harness.run_method_subprocess(__name__, {"flags": flags}, timeout=timeout)
    out = {k: timed.get(k) for k in ("step_time_s", "tokens_per_s", "final_loss", "saved_activation_bytes",
                                     "peak_memory_bytes", "losses", "valid_loss", "step_times_s")}
    # what the features report that a benchmark may read (policy evolution's switches and outlier counts, the
    # paper's Fig. 4); not per-layer detail
    keys = ("switches", "tracking_iterations", "tracks", "outlier_channels", "policy", "decisions",
            "predicted_peak_bytes", "over_budget")
    out["extensions"] = {name: {k: v for k, v in rep.items() if k in keys}
                         for name, rep in (timed.get("extensions") or {}).items()}
    out["peak_memory_source"] = timed["peak_memory_kind"]
    if memory_run and timed["device"] == "cpu":
        mem = harness.run_method_subprocess(__name__, {"flags": flags}, timeout=timeout,
                                            low_fragmentation_malloc=True)
        out["peak_memory_bytes"] = mem["peak_memory_bytes"]
        out["peak_memory_source"] = "peak_rss (MALLOC_MMAP_THRESHOLD_=65536 run)"
    return out


_INFEASIBLE = re.compile(r"smallest feasible budget is ([\d,]+) bytes")


def infeasible_bytes(message: str) -> int | None:
    """The smallest feasible budget a refusal of ``--adacc-policy auto`` names (its InfeasibleBudgetError's
    text), or None for any other message."""
    match = _INFEASIBLE.search(message or "")
    return int(match.group(1).replace(",", "")) if match else None


def auto_floor(flags: list[str]) -> int:
    """The smallest budget ``adacc train FLAGS --adacc-policy auto`` can keep, as the user's command finds it:
    a run asked for 1 MiB is refused naming it (after profiling and calibrating the process memory, which the
    runs after it then reuse). It is refused before it trains, so it keeps the flags' step count: a run shorter
    than the calibration's 30 steps calibrates over its own, and the floor holds for runs of that length."""
    try:
        train_method(flags + ["--adacc-policy", "auto", "--adacc-memory-budget", "1MiB"], memory_run=False)
    except RuntimeError as exc:
        found = infeasible_bytes(str(exc))
        if found is not None:
            return found
        raise
    raise RuntimeError("--adacc-policy auto kept a budget of 1 MiB: the refusal that names its floor never came")


def interleaved_runs(run, names, repeats: int) -> dict[str, list]:
    """``run(name)`` for every name, ``repeats`` rounds in alternation (A B A B ...), so that slow drifts in
    the machine's speed hit every method alike. Returns each name's results, one per round."""
    results: dict[str, list] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            results[name].append(run(name))
    return results


def interleaved_step_times(methods: dict[str, list[str]], repeats: int, timeout: float = 1800) -> dict[str, list]:
    """Fresh timed runs of each method in alternation (:func:`interleaved_runs`); each method's step times.

    A comparison against the fastest of many configurations must re-time that configuration this way: its
    sweep time is the minimum of many noisy draws, biased low against a method timed once."""
    def step_time(name: str) -> float:
        return harness.run_method_subprocess(__name__, {"flags": methods[name]}, timeout=timeout)["step_time_s"]

    return interleaved_runs(step_time, methods, repeats)


def _child(payload_path: str) -> None:
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    quiet_fallback_warnings()
    flags = json.load(open(payload_path))["flags"]
    summary = train(parse_train_args(flags + ["--no-progress"]))
    summary.pop("step_times_s", None)
    sys.stdout.flush()
    print()
    print(json.dumps(summary))


if __name__ == "__main__":
    _child(sys.argv[1])
