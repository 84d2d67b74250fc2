"""Pure-torch oracle of every compiled kernel in ``megatron_adacc._C``.

Each function here has exactly the signature and the output layout of its compiled twin, and performs the
same float32 operations in the same order, so the tests compare the two bit for bit. It also serves as the
implementation when the extension is not built (``backend() == "reference"``); it is correct there, only
slower and more memory hungry.

Shared conventions (also documented in ``csrc/adacc_common.h``):

* Values are read as float32; every scale and offset is float32; no fused multiply-add anywhere.
* Rounding is round-half-to-even (``torch.round``, ``rint`` in C++), applied after clamping to the code
  range (same result as clamping after rounding, because the bounds are integers).
* Groups are packed independently and each starts on a byte boundary; inside a byte, value ``j`` of the
  byte occupies bits ``[j*bits, (j+1)*bits)`` (little-endian). Padding bits are zero.
* A 4-bit code ``q`` in ``[-8, 7]`` is stored biased, as the nibble ``q + 8``.
* Every ``*_compress`` also returns ``bad``: an int32 tensor of one element, non-zero when the input held
  NaN or Inf (the compiled kernels find this inside their min/max pass).
* Finite input decodes to finite output. A group whose range ``max - min`` overflows float32 (values of
  both signs beyond about 1.7e38, or bfloat16's extremes) is quantized at a quarter of its values,
  which gives the float32 scale and offset of unbounded arithmetic (powers of two commute with
  rounding) and leaves every other group bit for bit as before. A decode that overflows is redone at
  a quarter and saturated, and every decode saturates at the output dtype's largest finite value:
  a code may lie up to half a step beyond the group's extreme value, which is itself finite.
"""

from __future__ import annotations

import torch

from megatron_adacc.codecs.base import TINY_SCALE

_M32 = 0xFFFFFFFF
_F32_MAX = torch.finfo(torch.float32).max
_QUARTER = 0.25


# --------------------------------------------------------------------------------------------- packing
def pack_groups(q: torch.Tensor, n: int, group: int, bits: int) -> torch.Tensor:
    """Pack codes ``q`` (``[ngroups, group]``, values < 2**bits, rows padded past ``n``) into bytes."""
    per_byte = 8 // bits
    ngroups = q.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=q.device)
    gp = -(-group // per_byte) * per_byte
    valid = torch.arange(ngroups * group, device=q.device).view(ngroups, group) < n
    q = torch.where(valid, q.to(torch.int32), 0)
    q = torch.nn.functional.pad(q, (0, gp - group)).view(ngroups, gp // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=q.device, dtype=torch.int32) * bits
    packed = (q << shifts).sum(-1).to(torch.uint8)  # [ngroups, bytes per full group]
    tail = n - (ngroups - 1) * group
    last = packed[-1, : -(-tail * bits // 8)]
    return torch.cat([packed[:-1].reshape(-1), last]).contiguous()


def unpack_groups(payload: torch.Tensor, n: int, group: int, bits: int) -> torch.Tensor:
    """Inverse of `pack_groups`: ``[ngroups, group]`` int32 codes (positions past ``n`` are zero)."""
    per_byte = 8 // bits
    ngroups = -(-n // group)
    full_bytes = -(-group * bits // 8)
    padded = torch.zeros(ngroups * full_bytes, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    b = padded.view(ngroups, full_bytes, 1).to(torch.int32)
    shifts = torch.arange(per_byte, device=payload.device, dtype=torch.int32) * bits
    q = (b >> shifts) & ((1 << bits) - 1)
    return q.reshape(ngroups, full_bytes * per_byte)[:, :group]


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` (1-D) as float32 ``[ngroups, group]``, the last group padded with its own last value so that
    padding never changes a group's min or max."""
    n = x.numel()
    ngroups = -(-n // group)
    xf = x.reshape(-1).float()
    pad = ngroups * group - n
    if pad:
        xf = torch.cat([xf, xf[-1:].expand(pad)])
    return xf.view(ngroups, group)


def _bad(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=x.device)
    return (~torch.isfinite(x.float())).any().to(torch.int32).reshape(1)


def _symmetric_scale(mx: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Scale covering ``[mn, mx]`` with codes ``[-8, 7]``: ``max(max(mx, 0) / 7, -min(mn, 0) / 8)``."""
    s = torch.maximum(mx.clamp_min(0) / 7, (-mn.clamp_max(0)) / 8)
    return torch.where(s < TINY_SCALE, torch.zeros_like(s), s)


def _inverse(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, 1.0 / s, torch.zeros_like(s))


def _range_scale(mx: torch.Tensor, mn: torch.Tensor, levels: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mx - mn) / levels`` per group, and the factor ``k`` (1, or 1/4 where ``mx - mn`` overflows) at
    which the group's values must be taken to compute codes without overflow. With one level (1-bit
    stochastic) an overflowing range has no float32 scale: it saturates at the largest finite value."""
    k = torch.where(mx - mn > _F32_MAX, _QUARTER, 1.0).to(mx.dtype)
    s = (mx * k - mn * k) / levels / k  # exactly (mx - mn) / levels where k == 1
    s = torch.where(s < TINY_SCALE, torch.zeros_like(s), s)
    return s.clamp_max(_F32_MAX), k


def _affine_decode(q: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``q * s + o`` (codes ``q`` as float32, ``s`` and ``o`` per group); where that overflows (the far
    codes of a group of overflowing range), the same at a quarter, saturated, times four."""
    v = q * s[:, None] + o[:, None]
    lim = _F32_MAX * _QUARTER
    w = (q * (s * _QUARTER)[:, None] + (o * _QUARTER)[:, None]).clamp(-lim, lim) * 4
    return torch.where(torch.isfinite(v), v, w)


def _saturate(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``v`` cast to ``dtype`` with values beyond its range clamped to its largest finite value."""
    big = torch.finfo(dtype).max
    return v.clamp(-big, big).to(dtype)


def _codes4(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` → biased nibbles ``round(clamp(v, -8, 7)) + 8``."""
    return (torch.round(v.clamp(-8, 7)) + 8).to(torch.int32)


# ----------------------------------------------------------------------------------- symmetric groups
def sym_int4_compress(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.numel()
    if n == 0:
        e = torch.empty(0, device=x.device)
        return e.to(torch.uint8), e.float(), _bad(x)
    g = _groups(x, group)
    s = _symmetric_scale(g.amax(1), g.amin(1))
    q = _codes4(g * _inverse(s)[:, None])
    return pack_groups(q, n, group, 4), s.contiguous(), _bad(x)


def sym_int4_decompress(payload: torch.Tensor, scales: torch.Tensor, group: int, out: torch.Tensor) -> None:
    n = out.numel()
    if n == 0:
        return
    q = unpack_groups(payload, n, group, 4)
    v = (q.float() - 8) * scales[:, None]
    out.copy_(_saturate(v.reshape(-1)[:n], out.dtype))


# ---------------------------------------------------------------------------------- asymmetric groups
def asym_int4_compress(
    x: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.numel()
    if n == 0:
        e = torch.empty(0, device=x.device)
        return e.to(torch.uint8), e.float(), e.float(), _bad(x)
    g = _groups(x, group)
    mx, mn = g.amax(1), g.amin(1)
    s, k = _range_scale(mx, mn, 15)
    o = (mn * k + 8 * (s * k)) / k
    q = _codes4((g * k[:, None] - (o * k)[:, None]) * _inverse(s * k)[:, None])
    return pack_groups(q, n, group, 4), s.contiguous(), o.contiguous(), _bad(x)


def asym_int4_decompress(
    payload: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int, out: torch.Tensor
) -> None:
    n = out.numel()
    if n == 0:
        return
    q = unpack_groups(payload, n, group, 4)
    v = _affine_decode(q.float() - 8, scales, offsets)
    out.copy_(_saturate(v.reshape(-1)[:n], out.dtype))


# ------------------------------------------------------------------------------------- channel-wise
def chan_int4_compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    if x.numel() == 0:
        e = torch.empty(0, device=x.device)
        return e.to(torch.uint8), torch.zeros(cols, device=x.device), _bad(x)
    xf = x.float()
    s = _symmetric_scale(xf.amax(0), xf.amin(0))
    q = _codes4(xf * _inverse(s)[None, :])
    return pack_groups(q, rows * cols, cols, 4), s.contiguous(), _bad(x)


def chan_int4_decompress(payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    rows, cols = out.shape
    if out.numel() == 0:
        return
    q = unpack_groups(payload, rows * cols, cols, 4)
    out.copy_(_saturate((q.float() - 8) * scales[None, :], out.dtype))


# ---------------------------------------------------------------------------------- outlier-separated
def channel_abs_sum(x: torch.Tensor) -> torch.Tensor:
    """Per-channel sum of absolute values in float64 (``S_h`` of Adacc eq. 1); NaN/Inf propagate."""
    return x.double().abs().sum(0)


def select_outlier_channels(abs_sums: torch.Tensor, z_threshold: float) -> torch.Tensor:
    """Adacc eq. 1: channels whose Z-score ``(S_h - mu) / sigma`` exceeds the threshold, as sorted int32.

    ``sigma`` is the population standard deviation. When all sums agree to nine significant digits
    (``sigma <= 1e-9 * |mu|``, which includes ``sigma == 0``) no channel is an outlier: the Z-scores would
    then only measure rounding noise. Both the compiled path and the reference call this one function, so
    they select the same channels whenever their float64 sums agree.
    """
    c = abs_sums.numel()
    if c < 2:
        return torch.empty(0, dtype=torch.int32, device=abs_sums.device)
    mu = abs_sums.mean()
    sigma = (abs_sums - mu).square().mean().sqrt()
    if not bool(sigma > 1e-9 * mu.abs()):
        return torch.empty(0, dtype=torch.int32, device=abs_sums.device)
    z = (abs_sums - mu) / sigma
    return torch.nonzero(z > _cut(z_threshold)).reshape(-1).to(torch.int32)


def _cut(z_threshold: float) -> float:
    """The Z-score a channel must exceed: the threshold, raised by nine significant digits. The compiled sums and
    the reference's add in different orders, so their Z-scores differ in the last bits; a channel exactly at the
    threshold (with two channels every Z-score is exactly 1 or -1) would be an outlier for one and not the other."""
    return z_threshold * (1.0 + 1e-9)


def top_outlier_channels(abs_sums: torch.Tensor, z_threshold: float, capacity: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_outlier_channels` at a fixed size, with no host read: the ``min(capacity, channels)`` channels of
    largest Z-score as sorted int32, and, as a 0-d int64 device tensor, how many channels that function selects
    (Z-score above the threshold, sums not all alike). Those are the first of the Z-score order, so whenever
    there are at most ``capacity`` of them every one is among the channels returned."""
    c = abs_sums.numel()
    k = max(0, min(int(capacity), c))
    if c < 2:
        return (torch.empty(0, dtype=torch.int32, device=abs_sums.device),
                torch.zeros((), dtype=torch.int64, device=abs_sums.device))
    mu = abs_sums.mean()
    sigma = (abs_sums - mu).square().mean().sqrt()
    z = (abs_sums - mu) / sigma
    count = ((z > _cut(z_threshold)) & (sigma > 1e-9 * mu.abs())).sum()
    # NaN Z-scores (all sums alike, or non-finite ones) rank anywhere: those channels are then stored exactly.
    idx = z.topk(k).indices.sort().values.to(torch.int32) if k else z.new_empty(0, dtype=torch.int32)
    return idx, count


def outlier_int4_compress(
    x: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outlier channels ``idx`` kept exactly (``[rows, k]`` in x's dtype); the rest, with those channels
    zeroed, quantized per row (token) in place, with no transpose (Adacc Fig. 3(b)(iii))."""
    rows, cols = x.shape
    idx_l = idx.long()
    outliers = x[:, idx_l].contiguous()
    dense = x.float().clone()
    dense[:, idx_l] = 0
    if x.numel() == 0:
        e = torch.empty(0, device=x.device)
        return e.to(torch.uint8), torch.zeros(rows, device=x.device), outliers, _bad(x)
    s = _symmetric_scale(dense.amax(1), dense.amin(1))
    q = _codes4(dense * _inverse(s)[:, None])
    return pack_groups(q, rows * cols, cols, 4), s.contiguous(), outliers, _bad(x)


def outlier_int4_decompress(
    payload: torch.Tensor, scales: torch.Tensor, outliers: torch.Tensor, idx: torch.Tensor, out: torch.Tensor
) -> None:
    rows, cols = out.shape
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= cols):  # a negative index would wrap around
        raise RuntimeError("outlier_int4_decompress: channel index out of range (damaged payload)")
    if out.numel() == 0:
        return
    q = unpack_groups(payload, rows * cols, cols, 4)
    out.copy_(_saturate((q.float() - 8) * scales[:, None], out.dtype))
    out[:, idx.long()] = outliers


# ---------------------------------------------------------------------------------------- bit masks
def bitmask_pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool/uint8 0-1 mask → 1 bit per value, little-endian in each byte; ``bad`` if a value exceeds 1."""
    n = x.numel()
    v = x.reshape(-1).to(torch.uint8)
    bad = (v > 1).any().to(torch.int32).reshape(1) if n else torch.zeros(1, dtype=torch.int32, device=x.device)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), bad
    return pack_groups(v.view(1, n), n, n, 1), bad


def bitmask_unpack(payload: torch.Tensor, out: torch.Tensor) -> None:
    n = out.numel()
    if n == 0:
        return
    out.copy_(unpack_groups(payload, n, n, 1).reshape(-1).to(out.dtype))


# ------------------------------------------------------------------------------- stochastic rounding
def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for ``a`` in ``[0, 2**32)`` without int64 overflow (16-bit halves of c)."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform24(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Counter-based random integers in ``[0, 2**24)`` for int64 element indices: two MurmurHash3
    finalizer rounds keyed by the 64-bit seed. Being a pure function of (seed, index), the stream does
    not depend on thread count or device, which is what makes CPU, CUDA and this reference agree."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    a = _fmix32((index & _M32) ^ k0)
    b = _fmix32((a + ((index >> 32) ^ k1)) & _M32)
    return b >> 8


def stochastic_compress(
    x: torch.Tensor, group: int, bits: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GACT/ActNN per-group quantizer: ``T = (x - min) / S`` with ``S = (max - min) / (2**bits - 1)``,
    rounded up with probability ``frac(T)`` (so ``E[q] = T``: unbiased)."""
    n = x.numel()
    if n == 0:
        e = torch.empty(0, device=x.device)
        return e.to(torch.uint8), e.float(), e.float(), _bad(x)
    g = _groups(x, group)
    mx, mn = g.amax(1), g.amin(1) + 0.0  # + 0.0: -0.0 -> +0.0 (min's signed zero depends on order)
    s, k = _range_scale(mx, mn, float((1 << bits) - 1))
    t = (g * k[:, None] - (mn * k)[:, None]) * _inverse(s * k)[:, None]
    base = t.trunc()
    frac = t - base
    index = torch.arange(g.numel(), device=x.device, dtype=torch.int64).view_as(g)
    u = uniform24(seed, index).float() * 2.0**-24
    q = (base + (u < frac).float()).clamp_max((1 << bits) - 1).to(torch.int32)
    return pack_groups(q, n, group, bits), mn.contiguous(), s.contiguous(), _bad(x)


def stochastic_decompress(
    payload: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bits: int,
    out: torch.Tensor,
) -> None:
    n = out.numel()
    if n == 0:
        return
    q = unpack_groups(payload, n, group, bits)
    v = _affine_decode(q.float(), scales, mins)
    out.copy_(_saturate(v.reshape(-1)[:n], out.dtype))


def get_codec(name: str, **params):  # noqa: ANN201 - returns a Codec
    """The codec ``name`` running on these pure-torch functions (the oracle the tests compare against)."""
    from megatron_adacc.codecs import registry  # a cycle at module level: the registry's kernels import this

    return registry.build(name, kernels="reference", **params)
