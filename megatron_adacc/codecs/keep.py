"""The identity codec, so that every policy decision (keep / compress / recompute) maps to a codec."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_adacc.codecs.base import Codec, Packed, _itemsize


class KeepCodec(Codec):
    """Keeps the tensor itself: no copy, lossless, any dtype.

    Unlike the other codecs, the `Packed` holds the input tensor (keeping it is the point), and
    ``decompress`` returns that same tensor. ``Packed.nbytes`` counts its whole storage, which exceeds the
    formula ``numel * itemsize`` only when the input is a view into a larger storage.
    """

    name = "keep"
    lossless = True

    def __init__(self, *, kernels: Any = None) -> None:
        del kernels

    def compress(self, x: torch.Tensor) -> Packed:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"keep codec expects a torch.Tensor, got {type(x).__name__}")
        return Packed(self.name, x.shape, x.dtype, x.device, {"data": x})

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        return p.tensors["data"]

    def compressed_nbytes(self, shape, dtype, **data_dependent: Any) -> int:  # noqa: ANN001
        return math.prod(shape) * _itemsize(dtype)
