"""The codec interface: `Codec.compress` turns a tensor into a `Packed`, `Codec.decompress` restores it.

A `Packed` holds only the storages the codec keeps (packed payload, scales, outliers...) plus the few
Python values needed to restore the original tensor (shape, dtype, device, codec parameters). It never
references the input tensor of a lossy codec, so the caller can free the activation as soon as
`compress` returns.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.saved import unique_storage_bytes

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""Input dtypes every quantizing codec accepts."""

TINY_SCALE: float = 2.0**-100
"""Scales below this are flushed to zero (the group decodes to zeros, or to its minimum for the min/max
codecs). Without the flush, ``1 / scale`` overflows for groups whose values are all subnormal-sized, and
``0 * inf`` would turn zeros into NaN. The absolute error this adds is below ``8 * 2**-100``."""


class NonFiniteInputError(AdaccError, ValueError):
    """The tensor holds NaN or Inf; the caller should keep it uncompressed.

    Quantization of a group that contains a NaN or an infinity would scale every other value in the group
    to zero or NaN, silently corrupting the gradients computed from the decompressed activation.
    """


class Packed:
    """A compressed tensor: the storages a codec keeps and what it needs to restore the original.

    ``tensors`` maps names to the tensors actually kept; ``nbytes`` is the exact number of bytes of
    their storages. ``meta`` holds small Python values (group size, bit width, seed...).
    """

    __slots__ = ("codec", "shape", "dtype", "device", "tensors", "meta")

    def __init__(
        self,
        codec: str,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.codec = codec
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device
        self.tensors = dict(tensors)
        self.meta = dict(meta or {})

    @property
    def nbytes(self) -> int:
        """Exact bytes held: the sum of the distinct storages kept (a storage shared twice counts once)."""
        return unique_storage_bytes(self.tensors.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def original_nbytes(self) -> int:
        """Bytes of the uncompressed tensor (contiguous)."""
        return self.numel * _itemsize(self.dtype)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={tuple(v.shape)}:{v.dtype}" for k, v in self.tensors.items())
        return (
            f"Packed(codec={self.codec!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, nbytes={self.nbytes}, {parts})"
        )


class Codec(ABC):
    """One way of storing an activation: ``compress`` / ``decompress`` and an exact size formula."""

    name: str = ""
    lossless: bool = False

    @abstractmethod
    def compress(self, x: torch.Tensor) -> Packed:
        """Compress ``x`` (any shape and strides). Raises `NonFiniteInputError` on NaN/Inf input."""

    @abstractmethod
    def decompress(self, p: Packed) -> torch.Tensor:
        """Restore a contiguous tensor with the original shape, dtype and device."""

    @abstractmethod
    def compressed_nbytes(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, **data_dependent: Any) -> int:
        """The documented size formula: bytes ``compress`` keeps for a tensor of this shape and dtype."""

    def params(self) -> dict[str, Any]:
        """The parameters this codec was built with (``get_codec(name, **params)`` rebuilds it)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def _check_packed(self, p: Packed) -> None:
        if p.codec != self.name:
            raise ValueError(f"{self.name!r} codec cannot decompress a tensor packed by {p.codec!r}")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_float_input(codec: str, x: torch.Tensor) -> None:
    """Reject dtypes the quantizers do not handle, with the fix in the message."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{codec} codec expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{codec} codec quantizes float32/float16/bfloat16 tensors, got {x.dtype}; "
            "use the 'keep' codec (or 'bitmask' for boolean masks) for this tensor"
        )


def rows_cols(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """View a tensor as ``[rows, channels]``: channels are the last dimension (1 for a 0-d tensor)."""
    shape = tuple(shape)
    if not shape:
        return 1, 1
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    return rows, cols


def packed_group_bytes(n: int, group: int, bits: int) -> int:
    """Bytes of ``n`` values of ``bits`` bits packed in groups of ``group`` values, each group starting
    on a byte boundary (a byte never spans two groups, so groups are packed independently)."""
    if n == 0:
        return 0
    full, tail = divmod(n, group)
    return full * _ceil_div(group * bits, 8) + _ceil_div(tail * bits, 8)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
