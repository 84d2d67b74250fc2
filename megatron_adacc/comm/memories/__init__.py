"""Error-feedback memories, one scheme per file: plain ``residual`` and ResiReduce ``a``, ``w``, ``d``,
``2d``, ``w+2d`` (plus ``none``, compression without error feedback)."""

from __future__ import annotations

from megatron_adacc.comm.base import Memory
from megatron_adacc.comm.memories.none import NoneMemory
from megatron_adacc.comm.memories.residual import ResidualMemory
from megatron_adacc.comm.memories.resireduce_2d import ResiReduce2D, RowColumnSelection
from megatron_adacc.comm.memories.resireduce_a import ResiReduceA, uniform_weights
from megatron_adacc.comm.memories.resireduce_d import ResiReduceD, RowSelection
from megatron_adacc.comm.memories.resireduce_w import ResiReduceW, significance_weights
from megatron_adacc.comm.memories.resireduce_w2d import ResiReduceW2D
from megatron_adacc.comm.options import DEFAULTS, SCHEMES


def build_memory(scheme: str, *, group_size: int = DEFAULTS.group_size, phi: float = DEFAULTS.phi,
                 ratio: float = DEFAULTS.ratio) -> Memory:
    """The memory of ``--resireduce SCHEME``."""
    if scheme == "none":
        return NoneMemory()
    if scheme == "residual":
        return ResidualMemory()
    if scheme == "a":
        return ResiReduceA(group_size)
    if scheme == "w":
        return ResiReduceW(group_size, phi)
    if scheme == "d":
        return ResiReduceD(ratio)
    if scheme == "2d":
        return ResiReduce2D(ratio)
    if scheme == "w+2d":
        return ResiReduceW2D(group_size, phi, ratio)
    raise ValueError(f"unknown residual scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


__all__ = [
    "SCHEMES",
    "NoneMemory",
    "ResidualMemory",
    "ResiReduceA",
    "ResiReduceW",
    "ResiReduceD",
    "ResiReduce2D",
    "ResiReduceW2D",
    "RowSelection",
    "RowColumnSelection",
    "build_memory",
    "significance_weights",
    "uniform_weights",
]
