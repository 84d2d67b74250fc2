"""Gradient compressors, one per file: ``topk``, ``dgc``, ``qsgd`` (and the identity ``none``)."""

from __future__ import annotations

from megatron_adacc.comm.base import Compressor
from megatron_adacc.comm.compressors.dgc import DGCCompressor
from megatron_adacc.comm.compressors.none import NoneCompressor
from megatron_adacc.comm.compressors.qsgd import QSGDCompressor
from megatron_adacc.comm.compressors.topk import TopKCompressor
from megatron_adacc.comm.options import COMPRESSORS, DEFAULTS


def build_compressor(name: str, *, density: float = DEFAULTS.density, qsgd_levels: int = DEFAULTS.qsgd_levels,
                     seed: int = 0) -> Compressor:
    """The compressor called ``name`` (``--grad-compressor``); ``seed`` should differ per rank."""
    if name == "topk":
        return TopKCompressor(density)
    if name == "dgc":
        return DGCCompressor(density, seed=seed)
    if name == "qsgd":
        return QSGDCompressor(qsgd_levels, seed=seed)
    if name == "none":
        return NoneCompressor()
    raise ValueError(f"unknown gradient compressor {name!r}; choose one of {', '.join(COMPRESSORS)}")


__all__ = [
    "COMPRESSORS",
    "DGCCompressor",
    "NoneCompressor",
    "QSGDCompressor",
    "TopKCompressor",
    "build_compressor",
]
