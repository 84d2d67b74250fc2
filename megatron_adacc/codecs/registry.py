"""Codec names → classes; `build` is what `get_codec` and `reference.get_codec` call."""

from __future__ import annotations

import inspect
from typing import Any

from megatron_adacc.codecs._backend import kernels as _kernels
from megatron_adacc.codecs.base import Codec
from megatron_adacc.codecs.bitmask import BitmaskCodec
from megatron_adacc.codecs.int4 import (
    Int4AsymmetricCodec,
    Int4ChannelwiseCodec,
    Int4OutlierCodec,
    Int4SmoothedCodec,
    Int4SymmetricCodec,
)
from megatron_adacc.codecs.keep import KeepCodec
from megatron_adacc.codecs.stochastic import StochasticCodec

CODECS: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (
        KeepCodec,
        Int4SymmetricCodec,
        Int4AsymmetricCodec,
        Int4ChannelwiseCodec,
        Int4SmoothedCodec,
        Int4OutlierCodec,
        BitmaskCodec,
        StochasticCodec,
    )
}


def build(name: str, kernels: str = "auto", **params: Any) -> Codec:
    try:
        cls = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(sorted(CODECS))}") from None
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kernels")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise TypeError(
            f"codec {name!r} got unknown parameter(s) {unknown}; it accepts {accepted or 'no parameters'}"
        )
    return cls(**params, kernels=_kernels(kernels))
