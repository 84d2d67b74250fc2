"""ResiReduce (seed 001): residual schemes side by side on 2 data-parallel ranks (gloo on CPU), and the bytes
each transport moves per rank at 2, 4 and 8 ranks.

Methods: ``no_compression`` (Megatron's all-reduce), ``ef_residual`` (Top-k with plain error feedback and
payloads all-gathered, the paper's Baseline), ``ef_residual_reduce_scatter`` (the same through the compressed
reduce-scatter, whose loss should stay within 1% of ``ef_residual``'s) and the ResiReduce schemes
``resireduce_a / _w / _d / _2d / _w2d`` with the same compressor (transport chosen by ``auto``).
Per method: residual memory (``residual_bytes``), model-state memory (``model_state_bytes``: parameters,
gradient buffers, optimizer states and residuals, measured from the storages actually allocated), bytes this
rank sends per step, step time (median), and the loss after a fixed number of steps on the embedded corpus
(every method sees the same batches). Paper goals against ``ef_residual``: model-state memory at least 13%
lower, loss within 1%, step time within 2%.

All methods of one timing round run in one pair of torchrun processes (import time dominates on CPU); rounds
alternate the method order. ``peak_memory_bytes`` (rank 0's peak RSS) comes from one extra process pair per
method with a fixed mmap threshold (see megatron_adacc/bench/common.py); ``--quick`` skips those runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from megatron_adacc.bench import _resireduce_transport as transport
from megatron_adacc.bench import harness
from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.core.log import Steps, echo
from megatron_adacc.core.tables import format_table

SCHEMES = {
    "no_compression": "off",
    "ef_residual": "residual",
    "ef_residual_reduce_scatter": "residual",
    "resireduce_a": "a",
    "resireduce_w": "w",
    "resireduce_d": "d",
    "resireduce_2d": "2d",
    "resireduce_w2d": "w+2d",
}
#: The transport a method forces (the others take ``auto``): the Baseline all-gathers, as before there was a choice.
TRANSPORT = {"ef_residual": "allgather", "ef_residual_reduce_scatter": "reduce-scatter"}

# 8 layers of hidden 128: four reusable groups per layer type at group size 4; the tied word embedding and
# the position embedding are the specific layers. Quick: 4 layers of hidden 64.
MODEL_FULL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size",
              "512", "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8"]
MODEL_QUICK = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size",
               "256", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4"]


def add_arguments(parser) -> None:
    parser.add_argument("--train-iters", type=int, default=None, help="Steps per method (default 60; 4 quick).")
    parser.add_argument("--rounds", type=int, default=None, help="Timing rounds (default 3; 1 quick).")
    parser.add_argument("--grad-compressor", default="topk", choices=("topk", "dgc", "qsgd"))
    parser.add_argument("--grad-compress-density", type=float, default=0.01)
    parser.add_argument("--resireduce-group-size", type=int, default=4)
    parser.add_argument("--resireduce-ratio", type=float, default=0.5)
    parser.add_argument("--methods", default=",".join(SCHEMES), help="Comma-separated subset of the methods.")
    parser.add_argument("--nproc", type=int, default=2, help="Data-parallel ranks (torchrun processes).")
    parser.add_argument("--transport-ranks", type=_rank_counts, default=None, metavar="N,N,...",
                        help="Ranks at which the transports' bytes are counted (default 2,4,8; 2,4 quick; '' to "
                             "skip).")
    parser.add_argument("--transport-compressors", type=_compressors, default=None, metavar="C,C,...",
                        help="Compressors whose transports' bytes are counted (default topk,qsgd; topk quick).")
    parser.add_argument("--transport-only", action="store_true",
                        help="Count the transports' bytes only, and replace the 'transport' rows of the results "
                             "file already written (bytes do not depend on the machine).")


def _rank_counts(text: str) -> list[int]:
    counts = [n.strip() for n in text.split(",") if n.strip()]
    if not all(n.isdigit() and int(n) >= 2 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: rank counts of 2 or more, comma-separated (e.g. 2,4,8)")
    return [int(n) for n in counts]


def _compressors(text: str) -> list[str]:
    names = [c for c in text.split(",") if c]
    if not names or not set(names) <= {"topk", "dgc", "qsgd"}:
        raise argparse.ArgumentTypeError(f"{text!r}: compressors among topk, dgc, qsgd, comma-separated")
    return names


def _flags(args, scheme: str, iters: int) -> list[str]:
    model = MODEL_QUICK if args.quick else MODEL_FULL
    micro, batch = (int(model[model.index(flag) + 1]) for flag in ("--micro-batch-size", "--global-batch-size"))
    flags = ["--device", "cpu", "--no-progress", "--train-iters", str(iters), "--lr", "3e-3", "--min-lr",
             "3e-4", "--lr-warmup-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0", *model,
             "--global-batch-size", str(max(batch, micro * args.nproc)), "--resireduce", scheme]
    if scheme != "off":
        flags += ["--grad-compressor", args.grad_compressor, "--grad-compress-density",
                  str(args.grad_compress_density), "--resireduce-group-size", str(args.resireduce_group_size),
                  "--resireduce-ratio", str(args.resireduce_ratio)]
    return flags


def _method_flags(args, name: str, iters: int) -> list[str]:
    flags = _flags(args, SCHEMES[name], iters)
    return flags + (["--resireduce-transport", TRANSPORT[name]] if name in TRANSPORT else [])


def _launch(runs: list[dict], nproc: int, low_fragmentation: bool = False, timeout: float = 3600) -> dict:
    return harness.run_method_subprocess(__name__, {"runs": runs}, env={"OMP_NUM_THREADS": "1"}, timeout=timeout,
                                         low_fragmentation_malloc=low_fragmentation, nproc=nproc)


def run(args) -> dict:
    ranks = args.transport_ranks if args.transport_ranks is not None else [2, 4] if args.quick else [2, 4, 8]
    compressors = args.transport_compressors or (["topk"] if args.quick else ["topk", "qsgd"])
    if args.transport_only:
        step = Steps(len(ranks), "resireduce")
        rows = _transport_rows(args, ranks, compressors, step)
        step.close()
        harness.update_results("resireduce", {"transport": rows}, args=args)
        return {}
    iters = args.train_iters or (4 if args.quick else 60)
    rounds = args.rounds or (1 if args.quick else 3)
    names = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(names) - set(SCHEMES))
    if unknown:
        raise IntegrationError(f"--methods: unknown {unknown}; known: {', '.join(SCHEMES)}")
    step = Steps(1 + (0 if args.quick else len(names)) + 1 + len(ranks), "resireduce")
    methods = _train_methods(args, names, iters, rounds, step)
    rows = _transport_rows(args, ranks, compressors, step)
    step.close()
    goals = _goals(methods)
    harness.print_table(
        methods, baseline="ef_residual" if "ef_residual" in methods else None,
        metrics=["residual_bytes", "model_state_bytes", "peak_memory_bytes", "bytes_sent_per_step",
                 "step_time_s", "reduce_overhead_s", "final_loss", "mean_loss_last5"],
        title=f"ResiReduce, {args.nproc} ranks on CPU, {args.grad_compressor} density "
              f"{args.grad_compress_density}, {iters} steps, {rounds} round(s)")
    for name, g in goals.items():
        if name == "ef_residual_reduce_scatter":
            echo(f"{name}: loss {g['loss_change_pct']:+.2f}% against the all-gather's (goal <= +1%), "
                 f"{g['bytes_sent_per_step_ratio']:.2f}x its bytes sent per step")
            continue
        echo(f"{name}: model state {g['model_state_saving_pct']:+.1f}% smaller than ef_residual (goal >= 13%),\n"
             f"  loss {g['loss_change_pct']:+.2f}% (goal <= +1%), step time {g['step_time_change_pct']:+.1f}% "
             f"(goal <= +2%; end to end, noisy on a shared CPU),\n  compression pipeline "
             f"{g['reduce_overhead_change_pct']:+.1f}%")
    harness.write_results(
        "resireduce",
        {"train_iters": iters, "rounds": rounds, "quick": args.quick, "nproc": args.nproc,
         "grad_compressor": args.grad_compressor, "density": args.grad_compress_density,
         "group_size": args.resireduce_group_size, "ratio": args.resireduce_ratio,
         "flags": _flags(args, "w+2d", iters)},
        methods, extra={"goals_vs_ef_residual": goals, "transport": rows}, args=args)
    return methods


def _train_methods(args, names: list[str], iters: int, rounds: int, step) -> dict[str, dict]:
    """Train every method (rounds alternating their order), measure peak memory and the pipeline's overhead."""
    order = []
    for r in range(rounds):
        order += names if r % 2 == 0 else names[::-1]
    step(f"timing {len(names)} methods x {rounds} round(s), {iters} steps each, {args.nproc} ranks")
    timed = _launch([{"name": n, "flags": _method_flags(args, n, iters)} for n in order], args.nproc)
    methods: dict[str, dict] = {}
    for name in names:
        results = timed[name]
        first = results[0]
        methods[name] = {
            "step_time_s": statistics.median(r["step_time_s"] for r in results),
            "step_time_s_per_round": [r["step_time_s"] for r in results],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "final_loss": first["final_loss"],
            "mean_loss_last5": statistics.fmean(first["losses"][-5:]),
            **{key: first[key] for key in ("residual_bytes", "owner_residual_bytes", "model_state_bytes",
                                           "param_bytes", "grad_bytes", "optimizer_state_bytes",
                                           "bytes_sent_per_step", "transport")},
            "compression_ratio": first["uncompressed_bytes_per_step"] / max(1, first["bytes_sent_per_step"]),
            "peak_memory_bytes": None,
            "losses": first["losses"],
        }
        if any(r["losses"] != first["losses"] for r in results[1:]):
            methods[name]["note"] = "losses differ between rounds (non-deterministic run)"
    if not args.quick:
        for name in names:
            step(f"peak memory of {name}")
            mem = _launch([{"name": name, "flags": _method_flags(args, name, min(iters, 10))}], args.nproc,
                          low_fragmentation=True)
            methods[name]["peak_memory_bytes"] = mem[name][0]["peak_memory_bytes"]
            methods[name]["peak_memory_source"] = "rank 0 peak RSS, MALLOC_MMAP_THRESHOLD_=65536 run"
    step("compression pipeline without communication")
    overhead = _reduce_overhead(args, timed["_slots"], [n for n in names if SCHEMES[n] != "off"],
                                reps=5 if args.quick else 30)
    for name, seconds in overhead.items():
        methods[name]["reduce_overhead_s"] = seconds
    return methods


def _transport_rows(args, ranks: list[int], compressors: list[str], step) -> list[dict]:
    """The ``transport`` rows (see :mod:`megatron_adacc.bench._resireduce_transport`), and their table."""
    if not ranks:
        return []
    rows = transport.measure(MODEL_QUICK if args.quick else MODEL_FULL, ranks, compressors,
                             args.grad_compress_density, step)
    head, lines = transport.table_rows(rows)
    echo(f"Bytes sent per rank per step, the busiest rank ({args.grad_compress_density} density for topk and "
         f"dgc; received in the JSON; fit: a (N-1)/N + b (N-1) over the measured N)\n"
         + format_table(head, lines, right=range(2, len(head))))
    return rows


def _reduce_overhead(args, slots: list, names: list[str], reps: int) -> dict[str, float]:
    """Seconds one step's compress / error-feedback pipeline takes per scheme, without communication.

    Runs here, in one process and one thread, on the trained model's parameter shapes with random gradients;
    the schemes alternate rep by rep and the median is kept, so this isolates what a residual scheme adds
    (the payload, hence the communication, is the same for every error-feedback scheme) from the noise of
    end-to-end step times on a shared machine.
    """
    import time

    import torch

    from megatron_adacc.comm import build_reducer
    from megatron_adacc.comm.base import ParamSlot

    torch.set_num_threads(1)
    params = [ParamSlot(n, tuple(shape), torch.float32, 0) for n, shape in slots]
    reducers = {}
    for name in names:
        reducer = build_reducer(SCHEMES[name], args.grad_compressor, density=args.grad_compress_density,
                                group_size=args.resireduce_group_size, ratio=args.resireduce_ratio)
        reducer.memory.register(params)
        reducers[name] = reducer
    gen = torch.Generator().manual_seed(0)
    grads = [(p.name, torch.randn(p.shape, generator=gen)) for p in params]
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps + 1):
        for name in names if rep % 2 == 0 else names[::-1]:
            batch = [(n, g.clone()) for n, g in grads]
            t0 = time.perf_counter()
            reducers[name].reduce(batch)
            if rep:  # the first rep warms up
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def _goals(methods: dict) -> dict:
    base = methods.get("ef_residual")
    if base is None:
        return {}
    out = {}
    transported = methods.get("ef_residual_reduce_scatter")
    if transported is not None:  # the same error feedback through the other transport: the loss should hold
        loss = 100 * (transported["mean_loss_last5"] / base["mean_loss_last5"] - 1)
        out["ef_residual_reduce_scatter"] = {
            "loss_change_pct": loss, "loss_goal_met": abs(loss) <= 1.0,
            "bytes_sent_per_step_ratio": transported["bytes_sent_per_step"] / max(1, base["bytes_sent_per_step"])}
    for name, m in methods.items():
        if not name.startswith("resireduce"):
            continue
        saving = 100 * (1 - m["model_state_bytes"] / base["model_state_bytes"])
        loss = 100 * (m["final_loss"] / base["final_loss"] - 1)
        step = 100 * (m["step_time_s"] / base["step_time_s"] - 1)
        overhead = 100 * (m.get("reduce_overhead_s", 0) / base.get("reduce_overhead_s", 1) - 1)
        # Loss goal: not more than 1% above plain error feedback (a lower loss is not a failure).
        out[name] = {"model_state_saving_pct": saving, "loss_change_pct": loss, "step_time_change_pct": step,
                     "reduce_overhead_change_pct": overhead,
                     "memory_goal_met": saving >= 13.0, "loss_goal_met": loss <= 1.0,
                     "step_time_goal_met": step <= 2.0}
    return out


def _child(payload_path: str) -> None:
    """One torchrun rank: train every requested method in turn; rank 0 prints all summaries as JSON."""
    import torch

    from megatron_adacc.comm.extension import measure_model_state
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    quiet_fallback_warnings()
    runs = json.load(open(payload_path))["runs"]
    captured: dict = {}
    build_optimizer = model_lib.build_optimizer

    def capturing_build_optimizer(args, ddp_model):
        # Keep the DDP wrapper and optimizer of the run so its model states can be measured afterwards.
        optimizer = build_optimizer(args, ddp_model)
        captured.update(ddp=ddp_model, optimizer=optimizer)
        return optimizer

    model_lib.build_optimizer = capturing_build_optimizer
    out: dict[str, list] = {}
    # A short throw-away run first, so that the first method measured does not pay the process's warm-up.
    warmup = list(runs[0]["flags"])
    warmup[warmup.index("--train-iters") + 1] = "2"
    train(parse_train_args(warmup))
    for spec in runs:
        captured.clear()
        summary = train(parse_train_args(spec["flags"]))
        report = summary["extensions"].get("resireduce", {})
        state = measure_model_state([captured["ddp"]], captured["optimizer"], report.get("residual_bytes", 0),
                                    report.get("owner_residual_bytes", 0))
        ddp = captured["ddp"]
        world = torch.distributed.get_world_size()
        uncompressed = sum(int(2 * (world - 1) / world * b.grad_data.numel() * b.grad_data.element_size())
                           for b in ddp.buffers)
        if "_slots" not in out:
            out["_slots"] = [[n, list(p.shape)] for n, p in ddp.module.named_parameters()]
        out.setdefault(spec["name"], []).append({
            "step_time_s": summary["step_time_s"], "tokens_per_s": summary["tokens_per_s"],
            "final_loss": summary["final_loss"], "losses": summary["losses"],
            "peak_memory_bytes": summary["peak_memory_bytes"],
            "bytes_sent_per_step": report.get("bytes_sent_per_step", uncompressed),
            "transport": report.get("transport"),
            "uncompressed_bytes_per_step": uncompressed,
            **state,
        })
        captured.clear()
    if torch.distributed.get_rank() == 0:
        sys.stdout.flush()
        print()
        print(json.dumps(out))


if __name__ == "__main__":
    _child(sys.argv[1])
