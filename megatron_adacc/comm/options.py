"""ResiReduce's tunables and their defaults, in one place: the flags, the builders and the extension read them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

#: Residual schemes, one file each under :mod:`megatron_adacc.comm.memories` (``none``: compression without
#: error feedback, which no flag selects).
SCHEMES = ("none", "residual", "a", "w", "d", "2d", "w+2d")
#: Gradient compressors, one file each under :mod:`megatron_adacc.comm.compressors` (``none``: the identity).
COMPRESSORS = ("topk", "dgc", "qsgd", "none")
#: How compressed payloads travel (``--resireduce-transport``): ``auto`` picks by the byte model
#: (:mod:`megatron_adacc.comm.transport`), ``allgather`` and ``reduce-scatter`` force one.
TRANSPORTS = ("auto", "allgather", "reduce-scatter")


@dataclass(frozen=True)
class ReducerOptions:
    """How gradients are compressed and which residual scheme keeps the error (seed paper 001)."""

    compressor: str = "topk"
    """Gradient compressor (``--grad-compressor``): topk, dgc or qsgd."""
    density: float = 0.01
    """Fraction of gradient entries sent by topk / dgc (``--grad-compress-density``)."""
    qsgd_levels: int = 16
    """Quantization levels of qsgd (``--qsgd-levels``)."""
    group_size: int = 4
    """Most adjacent similar layers sharing one residual, schemes a / w (``--resireduce-group-size``)."""
    phi: float = 0.5
    """Weight of the L1 term in ResiReduce-w's layer weights; L2 gets 1 - phi (``--resireduce-phi``)."""
    ratio: float = 0.5
    """Fraction of rows (and columns) of a specific layer's residual kept by d / 2d (``--resireduce-ratio``)."""
    transport: str = "auto"
    """How payloads travel between ranks (``--resireduce-transport``): auto, allgather or reduce-scatter."""

    #: argparse destination of each field.
    ARG_NAMES = {"compressor": "grad_compressor", "density": "grad_compress_density", "qsgd_levels": "qsgd_levels",
                 "group_size": "resireduce_group_size", "phi": "resireduce_phi", "ratio": "resireduce_ratio",
                 "transport": "resireduce_transport"}

    @classmethod
    def from_args(cls, args: Any) -> ReducerOptions:
        """The options of a parsed command line; a flag the host does not have keeps its default."""
        given = {f.name: getattr(args, cls.ARG_NAMES[f.name], None) for f in fields(cls)}
        return cls(**{name: value for name, value in given.items() if value is not None})


DEFAULTS = ReducerOptions()
