"""Finite input never decodes to NaN or Inf (issue #22), whatever the codec, backend and float dtype.

The inputs sit at the edges of each dtype: its largest finite value, the smallest normal, subnormals,
signed zeros, groups mixing both signs of huge values (their range max - min overflows float32, even for
bfloat16 values), constant and one-element tensors. Besides finiteness, every round trip must stay
within the codec's error bound computed from each group's range in float64 (not from the stored scales,
which a broken kernel could have made infinite), and the compiled kernels must still equal the
reference bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from codec_test_utils import (
    QUANTIZERS,
    assert_bitwise_equal,
    assert_packed_equal,
    check_bound,
    compress,
    ids,
    pair,
    per_element_scale,
)

from megatron_adacc.codecs import Packed, get_codec, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODECS = [*QUANTIZERS, ("keep", {})]
CASES = [
    "max", "neg_max", "max_and_neg_max", "lopsided", "tiny", "subnormals", "zeros", "huge_and_tiny",
    "all_equal", "single",
]  # fmt: skip


def extreme_input(dtype: torch.dtype, case: str) -> torch.Tensor:
    """One tensor of the named case. Alternating patterns use 5 columns, so that rows, columns and
    flattened groups of any size all mix the two values."""
    fi = torch.finfo(dtype)
    big, tiny, sub = fi.max, fi.tiny, fi.tiny * fi.eps  # sub: the smallest subnormal
    # lopsided: the scale comes from the positive side (0.9 max / 7), so -0.98 max rounds to code -8,
    # which decodes to -8 S, about -1.03 max: beyond the dtype unless the decode saturates.
    pairs = {"max_and_neg_max": (big, -big), "lopsided": (0.9 * big, -0.98 * big), "zeros": (0.0, -0.0)}
    if case in pairs:
        return torch.tensor(pairs[case] * 15, dtype=torch.float64).to(dtype).view(6, 5)
    constant = {"max": big, "neg_max": -big, "tiny": tiny, "all_equal": -0.75 * big}
    if case in constant:
        return torch.full((3, 7), constant[case], dtype=torch.float64).to(dtype)
    if case == "single":
        return torch.tensor([big], dtype=dtype)
    if case == "subnormals":
        values = [sub, -sub, 3 * sub, tiny - sub, -(tiny / 2), 0.0, tiny, -tiny]
    else:  # huge_and_tiny, shuffled so that each group size sees a different mix
        values = [big, -big, big / 3, -0.6 * big, tiny, -tiny, sub, -5 * sub, 0.0, 1.0, -2.5, 1e3]
    x = torch.tensor(values * 4, dtype=torch.float64).to(dtype)
    return x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(22))].view(4, -1)


def range_scales(name: str, params: dict, p: Packed, x: torch.Tensor) -> torch.Tensor:
    """Per group (channel, row), in float64, the step the codec's scale formula gives for the group's
    range: ``max(max+ / 7, -min- / 8)`` (symmetric), ``(max - min) / 15`` (asymmetric) and
    ``(max - min) / (2**bits - 1)`` (stochastic). Laid out like the stored ``scales``."""
    xd = x.double()
    if name == "int4_smoothed":  # per row of the scaled tensor
        xd = xd.reshape(-1, x.shape[-1]) / p.tensors["factors"].double()
    if name == "int4_channelwise":
        cols = xd.reshape(-1, x.shape[-1])
        mx, mn = cols.amax(0), cols.amin(0)
    elif name == "int4_outlier":
        rows = xd.reshape(-1, x.shape[-1]).clone()
        rows[:, p.tensors["index"].long()] = 0.0
        mx, mn = rows.amax(1), rows.amin(1)
    else:
        g = p.meta["group"]
        flat = xd.reshape(-1)
        flat = torch.cat([flat, flat[-1:].expand(-flat.numel() % g)])  # padding never moves min or max
        mx, mn = flat.view(-1, g).amax(1), flat.view(-1, g).amin(1)
    if name == "int4_asymmetric":
        return (mx - mn) / 15
    if name == "stochastic":
        return (mx - mn) / (2 ** params.get("bits", 4) - 1)
    return torch.maximum(mx.clamp_min(0) / 7, -mn.clamp_max(0) / 8)


def check_roundtrip(codec, params: dict, x: torch.Tensor) -> tuple[Packed, torch.Tensor]:
    p = compress(codec, x)
    y = codec.decompress(p)
    bad = ~torch.isfinite(y)
    assert not bad.any(), f"non-finite output for x={x[bad].tolist()}: {y[bad].tolist()}"
    for key, t in p.tensors.items():
        if t.is_floating_point():
            assert torch.isfinite(t).all(), f"non-finite {key}: {t.tolist()}"
    if codec.lossless:
        assert_bitwise_equal(y, x.contiguous())
    else:
        check_bound(codec.name, p, x, y, per_element_scale(codec.name, p, x, range_scales(codec.name, params, p, x)))
    return p, y


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "params"), CODECS, ids=ids(CODECS))
def test_reference_is_finite_and_bounded_at_dtype_extremes(name, params, dtype, case):
    check_roundtrip(reference.get_codec(name, **params), params, extreme_input(dtype, case))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "params"), CODECS, ids=ids(CODECS))
def test_cpu_kernels_are_finite_bounded_and_match_reference(isa, name, params, dtype, case):
    x = extreme_input(dtype, case)
    codec, oracle = pair(name, params)
    p, y = check_roundtrip(codec, params, x)
    q = compress(oracle, x)
    assert_packed_equal(p, q)
    assert_bitwise_equal(y, oracle.decompress(q))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "params"), CODECS, ids=ids(CODECS))
def test_cuda_is_finite_bounded_and_matches_reference(name, params, dtype):
    for case in CASES:
        x = extreme_input(dtype, case)
        p, y = check_roundtrip(get_codec(name, **params), params, x.cuda())
        q = compress(reference.get_codec(name, **params), x)
        assert_packed_equal(Packed(p.codec, p.shape, p.dtype, q.device, {k: t.cpu() for k, t in p.tensors.items()},
                                   p.meta), q)
        assert_bitwise_equal(y.cpu(), reference.get_codec(name, **params).decompress(q))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitmask_refuses_float_input_and_packs_its_mask(dtype):
    # A float tensor is never quantized to one bit (so it cannot come back as NaN); masks of it round-trip.
    x = extreme_input(dtype, "huge_and_tiny")
    codec = get_codec("bitmask")
    with pytest.raises(TypeError, match="bool or uint8"):
        codec.compress(x)
    m = x > 0
    assert_bitwise_equal(codec.decompress(codec.compress(m)), m)
