"""ResiReduce: compressed gradient communication with reduced error-feedback residuals (seed paper 001).

GRACE-shaped building blocks (:mod:`.base`): compressors (:mod:`.compressors`: topk, dgc, qsgd), memories
(:mod:`.memories`: plain residual and ResiReduce a / w / d / 2d / w+2d), communicators
(:mod:`.communicator`), strung together by :class:`.pipeline.CompressedReducer`. Integrations: Megatron
DDP (:mod:`.megatron_ddp`), torch DDP communication hook (:mod:`.ddp_hook`), and `adacc train`
(:func:`build_extension`).
"""

from __future__ import annotations

from megatron_adacc.comm.base import Communicator, Compressor, Memory, ParamSlot
from megatron_adacc.comm.compressors import build_compressor
from megatron_adacc.comm.memories import build_memory
from megatron_adacc.comm.pipeline import CompressedReducer


def build_reducer(
    scheme: str,
    compressor: str = "topk",
    *,
    density: float = 0.01,
    qsgd_levels: int = 16,
    group_size: int = 4,
    phi: float = 0.5,
    ratio: float = 0.5,
    seed: int = 0,
) -> CompressedReducer:
    """A reducer for ``--resireduce S --grad-compressor C``; ``seed`` should differ per rank."""
    return CompressedReducer(
        build_compressor(compressor, density=density, qsgd_levels=qsgd_levels, seed=seed),
        build_memory(scheme, group_size=group_size, phi=phi, ratio=ratio),
    )


def build_extension(args):
    """The `adacc train` extension for ``--resireduce`` (None when it is ``off``)."""
    from megatron_adacc.comm.extension import ResiReduceExtension

    if getattr(args, "resireduce", "off") == "off":
        return None
    return ResiReduceExtension.from_args(args)


__all__ = [
    "Communicator",
    "CompressedReducer",
    "Compressor",
    "Memory",
    "ParamSlot",
    "build_compressor",
    "build_extension",
    "build_memory",
    "build_reducer",
]
