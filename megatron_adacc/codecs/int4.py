"""Adacc's layer-specific INT4 codecs (seed 000, section 3.2).

All four keep 4-bit codes in ``[-8, 7]`` (two per byte) and float32 scales. They differ in how values are
grouped and in how outliers are treated:

* `Int4SymmetricCodec`: per group (row/token or fixed size); for Linear/LayerNorm/GELU inputs without
  outlier handling ("Adacc w/o outlier").
* `Int4AsymmetricCodec`: per group, min/max; for softmax outputs and attention scores (one-sided values).
* `Int4ChannelwiseCodec`: per channel (last dim); for Q, K and V.
* `Int4OutlierCodec`: outlier channels kept exactly, the rest symmetric per row; Linear/LayerNorm/GELU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_adacc.codecs.base import (
    Codec,
    Packed,
    _itemsize,
    assumed_outlier_fraction,
    check_float_input,
    mark_nonfinite,
    packed_group_bytes,
    rows_cols,
)
from megatron_adacc.codecs.reference import select_outlier_channels, top_outlier_channels


def resolve_group(group: str | int, shape: torch.Size | tuple[int, ...]) -> int:
    """Group size in elements: ``"row"`` is the last dimension (1 for a 0-d tensor)."""
    if group == "row":
        return max(rows_cols(shape)[1], 1)
    return int(group)


def _check_group(codec: str, group: Any) -> str | int:
    if group == "row":
        return group
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"{codec} codec: group must be 'row' or a positive int, got {group!r}")
    return group


class _GroupedInt4(Codec):
    """Shared body of the symmetric and asymmetric per-group codecs."""

    stats_per_group = 1  # float32 values kept per group (scale; scale + offset when asymmetric)

    def __init__(self, group: str | int = "row", *, kernels: Any) -> None:
        self.group = _check_group(self.name, group)
        self._k = kernels

    def params(self) -> dict[str, Any]:
        return {"group": self.group}

    def compressed_nbytes(self, shape, dtype, **data_dependent: Any) -> int:  # noqa: ANN001
        """``sum over groups of ceil(len/2)`` + ``4 * stats_per_group * ceil(n / group)``; for an even
        group size the first term is ``ceil(n / 2)``."""
        n = math.prod(shape)
        g = resolve_group(self.group, shape)
        return packed_group_bytes(n, g, 4) + 4 * self.stats_per_group * -(-n // g)


class Int4SymmetricCodec(_GroupedInt4):
    """Symmetric INT4 per group, Adacc eq. 2 with the scale made to cover the group.

    Eq. 2 takes ``S = max|x| / 8`` and clips to ``[-8, 7]``: a positive maximum then maps to 8 and is
    clipped to 7, an error of a full step ``S``. We use ``S = max(max(x, 0) / 7, -min(x, 0) / 8)``, the
    smallest scale whose code range ``[-8, 7]`` holds the whole group, so nothing clips and every value
    is within half a step: ``|x - x_hat| <= S / 2`` (plus float32 rounding). When the group's extreme
    value is negative this is exactly the paper's ``max|x| / 8``. Decode: ``x_hat = q * S``, saturated at
    the dtype's largest finite value: when ``S`` comes from the positive side, code -8 lies up to
    ``S / 2`` below the minimum, past ``-finfo.max`` for a minimum near it (an Inf without the clamp).
    """

    name = "int4_symmetric"

    def compress(self, x: torch.Tensor) -> Packed:
        check_float_input(self.name, x)
        x = x.detach()
        g = resolve_group(self.group, x.shape)
        payload, scales, bad = self._k.sym_int4_compress(x.contiguous().view(-1), g)
        return Packed(self.name, x.shape, x.dtype, x.device, {"payload": payload, "scales": scales}, {"group": g},
                      {"nonfinite": bad})

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        out = torch.empty(p.numel, dtype=p.dtype, device=p.device)
        self._k.sym_int4_decompress(p.tensors["payload"], p.tensors["scales"], p.meta["group"], out)
        return mark_nonfinite(out, p.nonfinite).view(p.shape)


class Int4AsymmetricCodec(_GroupedInt4):
    """Asymmetric (min/max) INT4 per group, Adacc eq. 3 with the corrected scale.

    The paper takes ``O = (max + min) / 2`` and ``S = (max - min) / 16``: the maximum then maps to
    ``(max - O) / S = 8``, outside the code range ``[-8, 7]``, and is clipped by one step. Sixteen codes
    span fifteen steps, so we use ``S = (max - min) / 15`` and ``O = min + 8 S`` (the minimum maps to -8,
    the maximum to 7): ``q = round((x - O) / S)``, decode ``x_hat = q * S + O`` (the paper's formula),
    and ``|x - x_hat| <= S / 2`` for every value. A constant group has ``S = 0`` and decodes exactly.

    A range ``max - min`` beyond float32 (values of both signs past about 1.7e38, e.g. bfloat16's
    extremes) is worked out at a quarter of the values: ``S`` and ``O`` are the same float32 numbers
    unbounded arithmetic would give, and the codes and the decode never overflow (issue #22).
    """

    name = "int4_asymmetric"
    stats_per_group = 2

    def compress(self, x: torch.Tensor) -> Packed:
        check_float_input(self.name, x)
        x = x.detach()
        g = resolve_group(self.group, x.shape)
        payload, scales, offsets, bad = self._k.asym_int4_compress(x.contiguous().view(-1), g)
        tensors = {"payload": payload, "scales": scales, "offsets": offsets}
        return Packed(self.name, x.shape, x.dtype, x.device, tensors, {"group": g}, {"nonfinite": bad})

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        out = torch.empty(p.numel, dtype=p.dtype, device=p.device)
        t = p.tensors
        self._k.asym_int4_decompress(t["payload"], t["scales"], t["offsets"], p.meta["group"], out)
        return mark_nonfinite(out, p.nonfinite).view(p.shape)


class Int4ChannelwiseCodec(Codec):
    """Symmetric INT4 with one scale per channel (last dimension), for Q, K and V.

    Scales as in `Int4SymmetricCodec`, taken over each channel's column; codes stay in row-major order
    (each row starts on a byte boundary), so no transpose is needed. Size:
    ``rows * ceil(channels / 2) + 4 * channels``.
    """

    name = "int4_channelwise"

    def __init__(self, *, kernels: Any) -> None:
        self._k = kernels

    def compressed_nbytes(self, shape, dtype, **data_dependent: Any) -> int:  # noqa: ANN001
        rows, cols = rows_cols(shape)
        return rows * -(-cols // 2) + 4 * cols

    def compress(self, x: torch.Tensor) -> Packed:
        check_float_input(self.name, x)
        x = x.detach()
        rows, cols = rows_cols(x.shape)
        payload, scales, bad = self._k.chan_int4_compress(x.contiguous().view(rows, cols))
        return Packed(self.name, x.shape, x.dtype, x.device, {"payload": payload, "scales": scales},
                      found={"nonfinite": bad})

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        out = torch.empty(rows_cols(p.shape), dtype=p.dtype, device=p.device)
        self._k.chan_int4_decompress(p.tensors["payload"], p.tensors["scales"], out)
        return mark_nonfinite(out, p.nonfinite).view(p.shape)


class Int4OutlierCodec(Codec):
    """Adacc's outlier-separated INT4 (Fig. 3(b)(iii) and (c)).

    Channels (last dimension) whose Z-score of absolute sums (eq. 1) exceeds ``z_threshold`` are outliers:
    they are stored exactly, in the input dtype, with their int32 indices, and zeroed in the dense part,
    which is quantized symmetrically per row in its original layout (no transpose). Size, with ``k`` channels
    stored exactly: ``rows * ceil(channels / 2) + 4 * rows + rows * k * itemsize + 4 * k``.

    Which channels, two ways (``compress``'s ``capacity``):

    * none given: exactly the outliers, `reference.select_outlier_channels`. Their number sizes the storage, so
      the host reads it: a sync on a GPU, for profiling and one-off calls.
    * ``capacity=k``: the ``k`` channels of largest Z-score, `reference.top_outlier_channels`, with no host read.
      When at most ``k`` channels are outliers all of them are stored exactly, and the rest of the ``k`` too
      (more accurate, never less); beyond ``k``, the smaller outliers are quantized with the dense part. The
      count of outliers is in ``found["outlier_channels"]``, on the device, so the caller can size the next
      call from it (Adacc's runtime: the previous step's count at the same place).
    """

    name = "int4_outlier"

    def __init__(self, z_threshold: float = 3.0, *, kernels: Any) -> None:
        if not (isinstance(z_threshold, (int, float)) and math.isfinite(z_threshold) and z_threshold > 0):
            # Zero or below would mark every channel an outlier: nothing compressed, silently.
            raise ValueError(f"int4_outlier codec: z_threshold must be a positive finite number, got "
                             f"{z_threshold!r}")
        self.z_threshold = float(z_threshold)
        self._k = kernels

    def params(self) -> dict[str, Any]:
        return {"z_threshold": self.z_threshold}

    def assumed_data(self, shape: tuple[int, ...] | torch.Size) -> dict[str, Any]:
        return {"num_outliers": round(assumed_outlier_fraction() * rows_cols(shape)[1])}

    def compressed_nbytes(self, shape, dtype, num_outliers: int = 0, **data_dependent: Any) -> int:  # noqa: ANN001
        rows, cols = rows_cols(shape)
        k = int(num_outliers)
        return rows * -(-cols // 2) + 4 * rows + rows * k * _itemsize(dtype) + 4 * k

    def compress(self, x: torch.Tensor, capacity: int | None = None) -> Packed:
        check_float_input(self.name, x)
        x = x.detach()
        rows, cols = rows_cols(x.shape)
        x2 = x.contiguous().view(rows, cols)
        sums = self._k.channel_abs_sum(x2)
        found = {}
        if capacity is None:
            idx = select_outlier_channels(sums, self.z_threshold)
        else:
            idx, found["outlier_channels"] = top_outlier_channels(sums, self.z_threshold, capacity)
        # NaN/Inf input: the kernel's flag, from the pass it makes anyway; the selection above is then arbitrary.
        payload, scales, outliers, found["nonfinite"] = self._k.outlier_int4_compress(x2, idx)
        tensors = {"payload": payload, "scales": scales, "outliers": outliers, "index": idx}
        return Packed(self.name, x.shape, x.dtype, x.device, tensors, found=found)

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        out = torch.empty(rows_cols(p.shape), dtype=p.dtype, device=p.device)
        t = p.tensors
        self._k.outlier_int4_decompress(t["payload"], t["scales"], t["outliers"], t["index"], out)
        return mark_nonfinite(out, p.nonfinite).view(p.shape)
