"""Adacc's layer-specific INT4 codecs (seed 000, section 3.2).

All four keep 4-bit codes in ``[-8, 7]`` (two per byte) and float32 scales. They differ in how values are
grouped and in how outliers are treated:

* `Int4SymmetricCodec`: per group (row/token or fixed size); for Linear/LayerNorm/GELU inputs without
  outlier handling ("Adacc w/o outlier").
* `Int4AsymmetricCodec`: per group, min/max; for softmax outputs and attention scores (one-sided values).
* `Int4ChannelwiseCodec`: per channel (last dim), the paper's codec for Q, K and V.
* `Int4SmoothedCodec`: per row after power-of-two per-channel factors; Adacc's default for Q, K and V.
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
from megatron_adacc.codecs.reference import _symmetric_scale, select_outlier_channels, top_outlier_channels


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


SMOOTHING_CHUNK = 1 << 18
"""Elements of the scaled copy `Int4SmoothedCodec` makes at a time: its working memory stays under 1 MiB (float32)
whatever the tensor's size, as the compiled codecs need none."""


SAMPLE_STRIDE = 7
"""`channel_factors` reads every 7th row: prime to any power-of-two head count, so every head of Q, K or V is read."""


def channel_factors(x2: torch.Tensor) -> torch.Tensor:
    """`Int4SmoothedCodec`'s candidate factors for ``x2`` ([rows, channels]): float32 powers of two, on the device.

    A channel's factor is ``sqrt(channel max / tensor max)`` (SmoothQuant's migration strength 0.5) rounded to a
    power of two, so that dividing by it and multiplying back are exact. Channels within 2x of the largest round
    to 1; so does every channel of an all-zero tensor or of one holding NaN/Inf. The maxima are taken over
    every `SAMPLE_STRIDE`-th row (outlier channels are a property of the channel, seen in any token): a seventh of
    the reads, and a candidate the samples got wrong is caught by the codec's error estimate over every row. No
    value is read on the host."""
    rows, cols = x2.shape
    ones = torch.ones(cols, dtype=torch.float32, device=x2.device)
    if rows * cols == 0:
        return ones
    sample = x2[::SAMPLE_STRIDE] if rows >= 8 * SAMPLE_STRIDE else x2
    # amax and amin rather than aminmax: torch's column aminmax runs ten times slower on the CPU
    peak = torch.maximum(sample.amax(0).float(), -sample.amin(0).float())
    top = peak.max()
    ratio = (peak / top).clamp_min(torch.finfo(torch.float32).tiny)
    # 1 / factor must be finite in x's dtype: no smaller than 2^-15 for fp16
    least = 2.0 ** (1 - math.frexp(torch.finfo(x2.dtype).max)[1])
    factors = torch.exp2(torch.round(0.5 * torch.log2(ratio))).clamp_min(least)
    usable = torch.isfinite(top) & (top > 0) & torch.isfinite(factors) & (peak > 0)  # a zero channel has nothing
    return torch.where(usable, factors, ones)


def _scaled_chunks(x2: torch.Tensor, factors: torch.Tensor):
    """``x2 / factors`` in blocks of whole rows of about `SMOOTHING_CHUNK` elements (exact: powers of two). Every
    block is a view of one scratch buffer, valid until the next is made: fresh blocks each paid their page faults."""
    rows, cols = x2.shape
    step = max(1, SMOOTHING_CHUNK // max(cols, 1))
    inverse = (1.0 / factors).to(x2.dtype)
    scratch = torch.empty(min(step, rows), cols, dtype=x2.dtype, device=x2.device)
    for r0 in range(0, rows, step):
        block = x2[r0:r0 + step]
        yield torch.mul(block, inverse, out=scratch[:block.shape[0]])


def _squared_steps(scales: torch.Tensor) -> torch.Tensor:
    return (scales.double() ** 2).sum()


def _host_reads_are_free(device: torch.device) -> bool:
    """Whether the codec may branch on a value of the data: on the CPU it costs nothing; on a GPU it would stall
    the launch queue at every Q, K and V, so both encodings are made there and one is selected on the device."""
    return device.type == "cpu"


class Int4SmoothedCodec(Codec):
    """Symmetric INT4 per row after dividing each channel (last dimension) by a power of two, for Q, K and V.

    The paper quantizes Q, K and V per channel because trained models put their outliers in a few fixed
    channels. One scale per channel over every token is then far coarser than plain INT4's scale per row
    (per token and head): on the untrained models of ``adacc bench gradients`` it has 1.4-1.5x plain INT4's
    gradient error. This codec keeps the channel-wise view where it pays. Each channel is divided by its
    `channel_factors` factor (1 for channels of like magnitude, less for outlier channels, so that a row's scale is
    no longer set by them) and the result is quantized per row as `Int4SymmetricCodec` does, if that lowers the
    expected squared error: ``sum over rows of S_r^2 * sum of f_j^2`` against ``S_r^2 * channels`` unscaled (a
    step ``S`` errs by ``S^2 / 12`` on average). Otherwise, and wherever every factor is 1, the codes and scales
    are exactly plain INT4's and the stored factors are 1. Decode multiplies the per-row decode by the factors.

    Size: plain INT4's ``rows * ceil(channels / 2) + 4 * rows``, plus ``4 * channels``. Working memory: a scaled
    copy of at most `SMOOTHING_CHUNK` elements at a time.
    """

    name = "int4_smoothed"

    def __init__(self, *, kernels: Any) -> None:
        self._k = kernels

    def compressed_nbytes(self, shape, dtype, **data_dependent: Any) -> int:  # noqa: ANN001
        rows, cols = rows_cols(shape)
        n, group = rows * cols, max(cols, 1)
        return packed_group_bytes(n, group, 4) + 4 * -(-n // group) + 4 * cols

    def compress(self, x: torch.Tensor) -> Packed:
        check_float_input(self.name, x)
        x = x.detach()
        rows, cols = rows_cols(x.shape)
        x2 = x.contiguous().view(rows, cols)
        group = max(cols, 1)
        factors = channel_factors(x2)
        ones = torch.ones_like(factors)
        on_host = _host_reads_are_free(x.device)

        def packed(codes: tuple, kept_factors: torch.Tensor) -> Packed:
            payload, scales, bad = codes
            return Packed(self.name, x.shape, x.dtype, x.device,
                          {"payload": payload, "scales": scales, "factors": kept_factors}, {"group": group},
                          {"nonfinite": bad})

        if rows * cols == 0 or (on_host and bool((factors == 1).all())):
            return packed(self._k.sym_int4_compress(x2.view(-1), group), ones)
        parts = [self._k.sym_int4_compress(y.reshape(-1), group) for y in _scaled_chunks(x2, factors)]
        # its NaN/Inf flag is never needed: the scaled codes are kept only where the estimate, so the input, is finite
        scaled = (*(torch.cat([part[i] for part in parts]) for i in (0, 1)), parts[0][2])
        plain_steps = _squared_steps(_symmetric_scale(x2.amax(1).float(), x2.amin(1).float())) * cols
        # False where the scaled values overflowed (a channel larger in rows the samples skipped): plain INT4 then
        use = _squared_steps(scaled[1]) * _squared_steps(factors) < plain_steps
        if on_host and bool(use):
            return packed(scaled, factors)
        plain = self._k.sym_int4_compress(x2.view(-1), group)
        if on_host:
            return packed(plain, ones)
        return packed((torch.where(use, scaled[0], plain[0]), torch.where(use, scaled[1], plain[1]), plain[2]),
                      torch.where(use, factors, ones))

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        rows, cols = rows_cols(p.shape)
        out = torch.empty(rows, cols, dtype=p.dtype, device=p.device)
        self._k.sym_int4_decompress(p.tensors["payload"], p.tensors["scales"], p.meta["group"], out.view(-1))
        factors = p.tensors["factors"]
        if not (_host_reads_are_free(p.device) and bool((factors == 1).all())):
            out.mul_(factors.to(p.dtype))  # exact: powers of two
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
