"""GACT side by side: no compression (L0), fixed 4-bit, adaptive 4-bit average (L1), L1 + full recompute (CB1).

Every method is a real `adacc train` run of megatron-core's GPT in its own process. Reported per method:

* ``saved_activation_bytes``: bytes held for backward after one micro-batch's forward (GACT's own count of
  packed payloads + kept storages; the autograd meter for L0), no allocator involved;
* ``peak_memory_bytes``: peak RSS of a separate run with ``MALLOC_MMAP_THRESHOLD_=65536`` (see
  docs/measuring.md); not measured with ``--quick``, which runs all methods in one process to stay under a
  minute;
* ``largest_micro_batch``: the largest micro-batch whose bytes held for backward fit the budget, the bytes
  L0 holds at the configured micro-batch; activation bytes are linear in the micro-batch, so it is the
  budget over the measured bytes per sample;
* ``step_time_s`` (median, first step excluded: it runs the sensitivity probes), ``tokens_per_s``,
  ``final_loss`` after the fixed number of steps, and for the adaptive methods the probe time, bit histogram
  and predicted compression variance.

``gact_fixed4`` is L1's machinery with adaptation off (``--no-gact-adaptive``: every tensor at 4 bits).
"""

from __future__ import annotations

import json
import sys

from megatron_adacc.bench import harness
from megatron_adacc.core.log import Steps

#: Bits re-allocated once, at the start: the benchmark times steady steps (``adacc train`` refuses GACT's flags
#: when GACT is off, so L0 runs without it).
_ADAPT_ONCE = ["--gact-adapt-interval", "1000"]
METHODS: dict[str, tuple[list[str], dict]] = {
    "gact_L0": (["--gact-level", "L0"], {}),
    "gact_fixed4": (["--gact-level", "L1", "--gact-bits", "4", "--no-gact-adaptive", *_ADAPT_ONCE], {}),
    "gact_L1": (["--gact-level", "L1", "--gact-bits", "4", *_ADAPT_ONCE], {}),
    "gact_CB1": (["--gact-level", "CB1", "--gact-bits", "4", *_ADAPT_ONCE], {}),
}

#: (name, flags, steps, steps with --quick). The default `adacc train` model and a larger one.
CONFIGS = (
    ("tiny", ["--config", "tiny"], 8),
    ("cpu-large", ["--config", "cpu-large", "--micro-batch-size", "4", "--global-batch-size", "4"], 3),
)
QUICK = ("tiny-quick", ["--config", "tiny", "--num-layers", "2", "--seq-length", "64",
                        "--micro-batch-size", "4", "--global-batch-size", "4"], 6)

_KEEP = ("step_time_s", "tokens_per_s", "final_loss", "saved_activation_bytes", "peak_memory_bytes",
         "losses", "device")
_GACT_KEYS = ("raw_saved_activation_bytes", "gact_compression_ratio", "gact_effective_bits",
              "gact_bits_histogram", "gact_probe_seconds", "gact_predicted_variance", "gact_gradient_variance",
              "gact_tensors", "gact_notes")


def add_arguments(parser) -> None:
    parser.add_argument("--configs", nargs="*", default=None, choices=[c[0] for c in CONFIGS],
                        help="Which model configs to run (default: all; --quick runs one small config).")
    parser.add_argument("--train-iters", type=int, default=None, help="Steps per method (overrides the default).")
    parser.add_argument("--methods", nargs="*", default=None, choices=list(METHODS), help="Subset of methods.")


def _run(flags: list[str], attrs: dict, memory: bool) -> dict:
    return harness.run_method_subprocess(__name__, {"flags": flags, "attrs": attrs}, timeout=3600,
                                         low_fragmentation_malloc=memory)


def _method(flags: list[str], attrs: dict, separate_memory_run: bool) -> dict:
    timed = _run(flags, attrs, memory=False)
    out = {k: timed.get(k) for k in _KEEP}
    out.update({k: timed["gact"].get(k) for k in _GACT_KEYS if k in timed.get("gact", {})})
    out["peak_memory_source"] = "peak_rss (timed run, default malloc)"
    if separate_memory_run and timed["device"] == "cpu":
        mem = _run(flags, attrs, memory=True)
        out["peak_memory_bytes"] = mem["peak_memory_bytes"]
        out["peak_memory_source"] = "peak_rss (MALLOC_MMAP_THRESHOLD_=65536 run)"
    elif timed["device"] == "cuda":
        out["peak_memory_source"] = "cuda_max_allocated"
    return out


def _quick_methods(base: list[str], names: list[str]) -> dict[str, dict]:
    """--quick: every method in one child process (one megatron import instead of four). Peak RSS is then
    shared by the methods and meaningless per method, so it is not reported."""
    payload = {"runs": {n: {"flags": base + METHODS[n][0], "attrs": METHODS[n][1]} for n in names}}
    results = harness.run_method_subprocess(__name__, payload, timeout=600)
    out = {}
    for name, timed in results.items():
        res = {k: timed.get(k) for k in _KEEP}
        res.update({k: timed["gact"].get(k) for k in _GACT_KEYS if k in timed.get("gact", {})})
        res["peak_memory_bytes"] = None
        res["peak_memory_source"] = "not measured with --quick (methods share one process)"
        out[name] = res
    return out


def _micro_batch(flags: list[str]) -> int:
    from megatron_adacc.training.args import parse_train_args

    return parse_train_args(flags + ["--no-progress"]).micro_batch_size


def run(args) -> dict:
    configs = [QUICK] if args.quick else [c for c in CONFIGS if not args.configs or c[0] in args.configs]
    names = args.methods or list(METHODS)
    all_methods: dict[str, dict] = {}
    step = Steps(len(configs) * (1 if args.quick else len(names)), "gact")
    for cname, cflags, steps in configs:
        iters = args.train_iters or steps
        base = cflags + ["--train-iters", str(iters)]
        mb = _micro_batch(base)
        methods: dict[str, dict] = {}
        if args.quick:
            step(f"{cname}: {', '.join(names)} in one process")
            methods = _quick_methods(base, names)
        for name in [] if args.quick else names:
            flags, attrs = METHODS[name]
            step(f"{cname}: {name}")
            methods[name] = _method(base + flags, attrs, separate_memory_run=True)
        budget = methods.get("gact_L0", {}).get("saved_activation_bytes")
        for res in methods.values():
            per_sample = (res.get("saved_activation_bytes") or 0) / mb
            res["largest_micro_batch"] = int(budget // per_sample) if budget and per_sample else None
            res.pop("losses", None)
        harness.print_table(
            methods, baseline="gact_L0" if "gact_L0" in methods else None,
            metrics=["saved_activation_bytes", "peak_memory_bytes", "largest_micro_batch", "step_time_s",
                     "final_loss"],
            title=f"GACT, config {cname} (micro-batch {mb}, {iters} steps; budget = L0's bytes held for "
                  f"backward = {budget})")
        for name, res in methods.items():
            all_methods[f"{name}@{cname}" if len(configs) > 1 else name] = res
    step.close()
    flat_config = {"configs": {c[0]: c[1] for c in configs}, "quick": args.quick,
                   "train_iters": args.train_iters, "largest_micro_batch_budget": "L0 saved_activation_bytes"}
    harness.write_results("gact", flat_config, all_methods, args=args)
    return all_methods


def _child(payload_path: str) -> None:
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    quiet_fallback_warnings()
    payload = json.load(open(payload_path))

    def one(spec: dict) -> dict:
        targs = parse_train_args(spec["flags"] + ["--no-progress"])
        for key, value in spec.get("attrs", {}).items():
            setattr(targs, key, value)
        summary = train(targs)
        summary.pop("step_times_s", None)
        summary["gact"] = summary.get("extensions", {}).get("gact", {})
        return summary

    if "runs" in payload:
        result = {name: one(spec) for name, spec in payload["runs"].items()}
    else:
        result = one(payload)
    sys.stdout.flush()
    print()
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    _child(sys.argv[1])
