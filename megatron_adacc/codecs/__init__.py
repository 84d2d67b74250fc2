"""Activation codecs: keep, Adacc's layer-specific INT4 quantizers, 1-bit dropout masks, GACT's
stochastic quantizer.

    codec = get_codec("int4_outlier", z_threshold=3.0)
    packed = codec.compress(x)          # never reads a device value (no host sync on a GPU)
    packed.nbytes                       # exact bytes held
    packed.raise_if_nonfinite()         # NonFiniteInputError if x held NaN/Inf (reads the device flag)
    x_hat = codec.decompress(packed)    # same shape, dtype and device as x; NaN first if x held NaN/Inf

Kernels come from the compiled ``megatron_adacc._C`` (see `backend`); `reference` holds the pure-torch
oracle of each. Set ``ADACC_REQUIRE_EXT=1`` to make a missing extension an import error.
"""

from __future__ import annotations

from typing import Any

from megatron_adacc.codecs import reference
from megatron_adacc.codecs._backend import backend
from megatron_adacc.codecs.base import FLOAT_DTYPES, TINY_SCALE, Codec, NonFiniteInputError, Packed
from megatron_adacc.codecs.registry import CODECS, build


def get_codec(name: str, **params: Any) -> Codec:
    """The codec ``name`` (one of `CODEC_NAMES`) with its parameters:

    * ``"keep"``; ``"bitmask"``; ``"int4_channelwise"``; ``"int4_smoothed"``
    * ``"int4_symmetric"`` and ``"int4_asymmetric"``: ``group="row"`` (last dimension) or an int size
    * ``"int4_outlier"``: ``z_threshold=3.0``
    * ``"stochastic"``: ``bits`` in {1, 2, 4, 8} (default 4), ``group_size=256``
    """
    return build(name, **params)


CODEC_NAMES: tuple[str, ...] = tuple(CODECS)

__all__ = [
    "CODEC_NAMES",
    "FLOAT_DTYPES",
    "TINY_SCALE",
    "Codec",
    "NonFiniteInputError",
    "Packed",
    "backend",
    "get_codec",
    "reference",
]
