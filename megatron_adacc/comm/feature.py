"""ResiReduce's entry in the plugin registry: ``--resireduce`` and its flags, what it refuses, what it builds."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_adacc.comm.options import COMPRESSORS, DEFAULTS, SCHEMES
from megatron_adacc.core.features import Feature, require

#: The flag's "off"; the memory called ``none`` (compression without error feedback) has no flag value.
OFF = "off"


def _density(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--grad-compress-density must be in (0, 1], got {text}")
    return value


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("resireduce", "ResiReduce: compressed gradient communication")
    g.add_argument("--resireduce", choices=(OFF, *(s for s in SCHEMES if s != "none")), default=OFF,
                   help="Error-feedback residual scheme: off (no compression), residual (plain error "
                        "feedback), a / w (residuals shared across similar layers: average / weighted), "
                        "d / 2d (residuals of specific layers compressed by rows / rows and columns), w+2d.")
    g.add_argument("--grad-compressor", choices=tuple(c for c in COMPRESSORS if c != "none"),
                   default=DEFAULTS.compressor, help="Gradient compressor used when --resireduce is not off.")
    g.add_argument("--grad-compress-density", type=_density, default=DEFAULTS.density, metavar="FRACTION",
                   help="Fraction of gradient entries sent by topk / dgc.")
    g.add_argument("--qsgd-levels", type=int, default=DEFAULTS.qsgd_levels, metavar="S",
                   help="Quantization levels of the qsgd compressor.")
    g.add_argument("--resireduce-group-size", type=int, default=DEFAULTS.group_size, metavar="N",
                   help="Largest number of adjacent similar layers that share one residual (schemes a, w).")
    g.add_argument("--resireduce-phi", type=float, default=DEFAULTS.phi, metavar="PHI",
                   help="Weight of the L1 term in ResiReduce-w's layer weights (L2 gets 1 - PHI).")
    g.add_argument("--resireduce-ratio", type=float, default=DEFAULTS.ratio, metavar="FRACTION",
                   help="Fraction of rows (and columns) of a specific layer's residual kept by d / 2d.")


def problems(args: Any) -> list[str]:
    found = []
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        found.append("--resireduce compresses Megatron DDP's bucket reduction; FSDP reduces gradients "
                     "elsewhere. Drop --use-megatron-fsdp / --use-torch-fsdp2")
    if (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        found.append("--resireduce does not support --num-distributed-optimizer-instances > 1")
    return found


def build_extensions(args: Any, config: Any) -> list:
    return [require(FEATURE, "megatron_adacc.comm.extension", "build_extension")(args)]


FEATURE = Feature(
    name="resireduce", flag="--resireduce", dest="resireduce", off=OFF,
    add_args=add_args, build_extensions=build_extensions, problems=problems,
    preflight=lambda args: require(FEATURE, "megatron_adacc.comm.extension", "build_extension"),
    flag_prefixes=("--resireduce", "--grad-compress", "--qsgd-"),
)
