"""ResiReduce's entry in the plugin registry: ``--resireduce`` and its flags, what it refuses, what it builds."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_adacc.comm.options import COMPRESSORS, DEFAULTS, SCHEMES, TRANSPORTS
from megatron_adacc.core.features import Feature, require
from megatron_adacc.core.units import checked, positive_int

#: The flag's "off"; the memory called ``none`` (compression without error feedback) has no flag value.
OFF = "off"


# Checked when parsed, so that a value the compressors would refuse deep in set-up is refused by its flag.
_LEVELS = checked(int, lambda s: 1 <= s <= 127, "levels in [1, 127] (int8 payload)")
_WEIGHT = checked(float, lambda p: 0 <= p <= 1, "a weight in [0, 1]")
_FRACTION = checked(float, lambda r: 0 < r <= 1, "a fraction in (0, 1]")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("resireduce", "ResiReduce: compressed gradient communication")
    g.add_argument("--resireduce", choices=(OFF, *(s for s in SCHEMES if s != "none")), default=OFF,
                   help="Error-feedback residual scheme: off (no compression), residual (plain error "
                        "feedback), a / w (residuals shared across similar layers: average / weighted), "
                        "d / 2d (residuals of specific layers compressed by rows / rows and columns), w+2d. "
                        "How the compressed gradients travel: --resireduce-transport.")
    g.add_argument("--grad-compressor", choices=tuple(c for c in COMPRESSORS if c != "none"),
                   default=DEFAULTS.compressor, help="Gradient compressor used when --resireduce is not off.")
    g.add_argument("--grad-compress-density", type=_FRACTION, default=DEFAULTS.density, metavar="FRACTION",
                   help="Fraction of gradient entries sent by topk / dgc.")
    g.add_argument("--qsgd-levels", type=_LEVELS, default=DEFAULTS.qsgd_levels, metavar="S",
                   help="Quantization levels of the qsgd compressor.")
    g.add_argument("--resireduce-group-size", type=positive_int, default=DEFAULTS.group_size, metavar="N",
                   help="Largest number of adjacent similar layers that share one residual (schemes a, w).")
    g.add_argument("--resireduce-phi", type=_WEIGHT, default=DEFAULTS.phi, metavar="PHI",
                   help="Weight of the L1 term in ResiReduce-w's layer weights (L2 gets 1 - PHI).")
    g.add_argument("--resireduce-ratio", type=_FRACTION, default=DEFAULTS.ratio, metavar="FRACTION",
                   help="Fraction of rows (and columns) of a specific layer's residual kept by d / 2d.")
    g.add_argument("--resireduce-transport", choices=TRANSPORTS, default=DEFAULTS.transport,
                   help="How compressed gradients travel between N data-parallel ranks, P one rank's payload. "
                        "allgather: every rank receives every payload, (N-1)*P bytes sent and received per "
                        "rank. reduce-scatter: each rank owns 1/N of every bucket, receives that part of every "
                        "payload, compresses their sum again (topk/dgc keep 4 payloads' entries, qsgd "
                        "127 levels; what that drops waits in an owner residual of 1/N of the gradients) and "
                        "all-gathers it: about 5*(N-1)/N*P each way for topk/dgc, 2*(N-1)/N*P for "
                        "qsgd, (N-1)/N*P with --use-distributed-optimizer. auto (default): the fewer bytes, "
                        "i.e. allgather up to 5 ranks for topk/dgc and 2 for qsgd, reduce-scatter beyond, and "
                        "from 2 ranks with the distributed optimizer. docs/resireduce.md has the details.")


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
