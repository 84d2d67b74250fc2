"""GACT's entry in the plugin registry: ``--gact-level`` and its flags, what it refuses, what it builds."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_adacc.core.features import Feature, require, saved_tensor_hook_problems
from megatron_adacc.core.units import checked, positive_int
from megatron_adacc.gact.levels import BIT_LEVELS, KEEP_BITS, Level

#: ``--gact-level`` values, lowest first.
LEVELS = tuple(level.value for level in Level)
_AVERAGE_BITS = checked(float, lambda b: min(BIT_LEVELS) <= b <= KEEP_BITS,
                        f"average bits in [{min(BIT_LEVELS)}, {KEEP_BITS}]")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gact", "GACT: adaptive-bit activation compression")
    g.add_argument("--gact-level", choices=LEVELS, default="L0",
                   help="GACT optimization level: L0 off, L1 adaptive bits, L2 L1 + swap to pinned CPU memory, "
                        "CB1 L1 + full recompute of compressed layer inputs, CB2 CB1 + memory-efficient "
                        "attention.")
    g.add_argument("--gact-bits", type=_AVERAGE_BITS, default=4.0, metavar="BITS",
                   help="Average bits per activation value for adaptive allocation.")
    g.add_argument("--gact-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="Adaptive per-tensor bits from sensitivity probes (--no-gact-adaptive: every tensor "
                        "at --gact-bits).")
    g.add_argument("--gact-adapt-interval", type=positive_int, default=1000, metavar="ITERS",
                   help="Re-estimate sensitivities and bit widths every ITERS iterations.")
    g.add_argument("--gact-group-size", type=positive_int, default=256, metavar="N",
                   help="Values per quantization group.")


def problems(args: Any) -> list[str]:
    found = saved_tensor_hook_problems("--gact-level", args)
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1 and getattr(args, "gact_adaptive", True):
        found.append("--gact-level's adaptive bits probe gradients with a plain forward and backward of one batch "
                     "through the rank's model, which a pipeline stage cannot run alone (its layers need the other "
                     "stages' activations and gradients); add --no-gact-adaptive (fixed bits, no probe) or use "
                     "--pipeline-model-parallel-size 1")
    return found


def build_extensions(args: Any, config: Any) -> list:
    return [require(FEATURE, "megatron_adacc.gact.extension", "build_extension")(args)]


FEATURE = Feature(
    name="gact", flag="--gact-level", dest="gact_level", off="L0",
    add_args=add_args, build_extensions=build_extensions, problems=problems,
    preflight=lambda args: require(FEATURE, "megatron_adacc.gact.extension", "build_extension"),
    flag_prefixes=("--gact-",),
)
