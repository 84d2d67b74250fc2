"""The codec interface: `Codec.compress` turns a tensor into a `Packed`, `Codec.decompress` restores it.

A `Packed` holds only the storages the codec keeps (packed payload, scales, outliers...) plus the few
Python values needed to restore the original tensor (shape, dtype, device, codec parameters). It never
references the input tensor of a lossy codec, so the caller can free the activation as soon as
`compress` returns.

Neither call reads a device value on the host (each would stop a GPU's launch queue): what a codec finds in the
data stays on the device in `Packed.found` (the NaN/Inf flag, how many outlier channels), for the caller to read
when it reads anyway. A tensor that held NaN/Inf is compressed as it is and decompresses with a NaN in its first
element, so nothing computed from it passes for finite (`Packed.raise_if_nonfinite` reads the flag at once).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.saved import has_data, unique_storage_bytes

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""Input dtypes every quantizing codec accepts."""

TINY_SCALE: float = 2.0**-100
"""Scales below this are flushed to zero (the group decodes to zeros, or to its minimum for the min/max
codecs). Without the flush, ``1 / scale`` overflows for groups whose values are all subnormal-sized, and
``0 * inf`` would turn zeros into NaN. The absolute error this adds is below ``8 * 2**-100``."""


class NonFiniteInputError(AdaccError, ValueError):
    """The tensor held NaN or Inf (raised by `Packed.raise_if_nonfinite`).

    Quantization of a group that contains a NaN or an infinity scales every other value in the group to zero,
    NaN or a wrong finite value; the decompressed tensor is therefore marked with a NaN (see the module).
    """


class Packed:
    """A compressed tensor: the storages a codec keeps and what it needs to restore the original.

    ``tensors`` maps names to the tensors actually kept; ``nbytes`` is the exact number of bytes of
    their storages. ``meta`` holds small Python values (group size, bit width, seed...). ``found`` holds what
    the codec found in the data as one-element device tensors, never read by the codec: ``"nonfinite"`` (non-zero
    when the input held NaN/Inf) and, for the outlier codec, ``"outlier_channels"``; not part of ``nbytes``.
    """

    __slots__ = ("codec", "shape", "dtype", "device", "tensors", "meta", "found")

    def __init__(
        self,
        codec: str,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        found: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.codec = codec
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device
        self.tensors = dict(tensors)
        self.meta = dict(meta or {})
        self.found = dict(found or {})

    @property
    def nonfinite(self) -> torch.Tensor | None:
        """The codec's NaN/Inf flag (a one-element device tensor, non-zero when the input held NaN/Inf)."""
        return self.found.get("nonfinite")

    def raise_if_nonfinite(self) -> None:
        """Raise `NonFiniteInputError` when the input held NaN/Inf. Reads the flag: a host sync on a GPU, for
        callers outside training (training tells the flags once per step: `core.saved.NONFINITE`)."""
        flag = self.nonfinite
        if flag is not None and int(flag.reshape(-1)[0].item()):
            raise NonFiniteInputError(
                f"{self.codec} codec: the input held NaN or Inf; its decompressed tensor is marked with a NaN "
                "(quantizing it corrupts every value of its group)"
            )

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
        """Compress ``x`` (any shape and strides). NaN/Inf input is flagged in ``found`` (see the module)."""

    @abstractmethod
    def decompress(self, p: Packed) -> torch.Tensor:
        """Restore a contiguous tensor with the original shape, dtype and device."""

    @abstractmethod
    def compressed_nbytes(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, **data_dependent: Any) -> int:
        """The documented size formula: bytes ``compress`` keeps for a tensor of this shape and dtype."""

    def params(self) -> dict[str, Any]:
        """The parameters this codec was built with (``get_codec(name, **params)`` rebuilds it)."""
        return {}

    def assumed_data(self, shape: tuple[int, ...] | torch.Size) -> dict[str, Any]:
        """The ``data_dependent`` arguments of :meth:`compressed_nbytes` for a tensor whose values no one can see
        (:func:`compress_with` of a tensor without data), as :func:`assuming` sets them; none for most codecs."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def _check_packed(self, p: Packed) -> None:
        if p.codec != self.name:
            raise ValueError(f"{self.name!r} codec cannot decompress a tensor packed by {p.codec!r}")


#: What sizing a tensor without data assumes of the values it does not have (:func:`assuming`).
_ASSUMED: dict[str, float] = {"outlier_fraction": 0.01}


@contextlib.contextmanager
def assuming(*, outlier_fraction: float) -> Iterator[None]:
    """Within the block, :func:`compress_with` of a tensor without data takes this share of its channels for outliers
    (the outlier-separated codec stores them exactly). 1% by default: the Z > 3 rule of eq. 1 keeps a handful of
    channels per tensor, and the profiler measures the real share wherever a model runs."""
    if not 0 <= outlier_fraction <= 1:
        raise ValueError(f"outlier_fraction must be a share in [0, 1], got {outlier_fraction}")
    before = dict(_ASSUMED)
    _ASSUMED["outlier_fraction"] = float(outlier_fraction)
    try:
        yield
    finally:
        _ASSUMED.update(before)


def assumed_outlier_fraction() -> float:
    """The share of channels :func:`compress_with` takes for outliers in a tensor without data (:func:`assuming`)."""
    return _ASSUMED["outlier_fraction"]


def compress_with(codec: Codec, x: torch.Tensor, **kwargs: Any) -> Packed:
    """``codec.compress(x, **kwargs)``. For a tensor without data (a meta or fake tensor: a model sized without
    allocating it, ``adacc plan``), a `Packed` of exactly the bytes the codec's size formula gives, with what
    depends on the values assumed (:func:`assuming`): the kernels have nothing to read, and the size is all such a
    run asks of a codec. Callers that may meet such tensors call this rather than ``codec.compress``."""
    if has_data(x):
        return codec.compress(x, **kwargs)
    nbytes = codec.compressed_nbytes(x.shape, x.dtype, **codec.assumed_data(x.shape))
    return Packed(codec.name, x.shape, x.dtype, x.device, {"sized": x.new_empty(nbytes, dtype=torch.uint8)})


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mark_nonfinite(out: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
    """``out`` with its first element NaN where ``flag`` is set (a decompressed tensor whose input held NaN/Inf),
    in place and without reading the flag; other values, signed zeros included, are left as they are."""
    if flag is not None and out.numel():
        out.view(-1)[:1].masked_fill_(flag.reshape(1) != 0, float("nan"))
    return out


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
