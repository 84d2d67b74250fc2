"""Megatron's own recompute modes side by side: none, selective (core attention), full (uniform, 1 layer).

The reference every Adacc benchmark compares against. Step time from default-allocator runs, peak memory from
low-fragmentation runs (see megatron_adacc/bench/common.py), bytes held for backward from the autograd meter.
"""

from __future__ import annotations

from megatron_adacc.bench import harness
from megatron_adacc.bench.common import train_method
from megatron_adacc.core.log import Steps

METHODS = {
    "megatron_none": [],
    "megatron_selective": ["--recompute-granularity", "selective"],
    "megatron_full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"],
}


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="tiny", help="Model config (a configs/ name or a TOML path).")
    parser.add_argument("--train-iters", type=int, default=None, help="Steps per method (default 30; 8 quick).")


def run(args) -> dict:
    iters = args.train_iters or (8 if args.quick else 30)
    base = ["--config", args.config, "--train-iters", str(iters)]
    if args.quick:
        base += ["--global-batch-size", "8", "--micro-batch-size", "8"]
    methods = {}
    with Steps(len(METHODS), "recompute") as step:
        for name, flags in step.iterate(METHODS.items(), label=lambda item: item[0]):
            result = train_method(base + flags)
            result.pop("losses")
            methods[name] = result
    harness.print_table(methods, baseline="megatron_none",
                        metrics=["step_time_s", "tokens_per_s", "peak_memory_bytes", "saved_activation_bytes",
                                 "final_loss"],
                        title=f"Megatron recompute modes, config {args.config}, {iters} steps")
    harness.write_results("recompute", {"config": args.config, "train_iters": iters, "quick": args.quick,
                                        "flags": base}, methods, args=args)
    return methods
