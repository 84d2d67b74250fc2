"""Hypothesis property tests: shapes, dtypes, strides, empty tensors, constant and zero groups, group
sizes not dividing the size. Properties: compiled == reference bit for bit, exact restore of shape, dtype
and device, the per-codec error bound, and nbytes == the documented formula."""

from __future__ import annotations

import pytest
import torch
from codec_test_utils import (
    EXT,
    QUANTIZERS,
    assert_bitwise_equal,
    assert_packed_equal,
    check_bound,
    compress,
    num_outliers,
    pair,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_adacc.codecs import get_codec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def tensors(draw):
    """A float tensor of random shape and dtype, possibly non-contiguous, with a chosen value pattern."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    if 0 < ndim <= 2 and draw(st.booleans()):  # long rows (vector blocks + tails), bounded total size
        shape = shape[:-1] + (draw(st.integers(0, 300)),)
    dtype = draw(st.sampled_from(DTYPES))
    pattern = draw(st.sampled_from(["normal", "wide", "zeros", "constant", "positive", "sparse"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    if pattern == "wide":  # magnitudes spanning many binades, including tiny and (for fp16) subnormal
        base = base * torch.exp2(torch.randint(-30, 12, shape, generator=g).float())
    elif pattern == "zeros":
        base = torch.zeros(shape)
    elif pattern == "constant":
        base = torch.full(shape, draw(st.sampled_from([-2.5, 0.0, 1e-3, 7.0])))
    elif pattern == "positive":  # softmax-like
        base = torch.rand(shape, generator=g)
    elif pattern == "sparse":
        base = base * (torch.rand(shape, generator=g) < 0.1)
    x = base.to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and x.dim() >= 2:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, non-contiguous
    elif layout == "strided" and x.dim() >= 1:
        x = torch.stack([x, x], dim=-1)[..., 0]  # every other element of a larger storage
    return x


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=[f"{n}{p}" for n, p in QUANTIZERS])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=tensors())
def test_quantizer_properties(name, params, x):
    codec, oracle = pair(name, params)
    p = compress(codec, x)
    y = codec.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device and y.is_contiguous()
    assert p.nbytes == codec.compressed_nbytes(x.shape, x.dtype, num_outliers=num_outliers(p))
    check_bound(name, p, x, y)
    if EXT is not None:
        q = compress(oracle, x)
        assert_packed_equal(p, q)
        assert_bitwise_equal(y, oracle.decompress(q))


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    dtype=st.sampled_from([torch.bool, torch.uint8]),
    density=st.floats(0.0, 1.0),
    strided=st.booleans(),
)
def test_bitmask_properties(shape, dtype, density, strided):
    m = (torch.rand(shape) < density).to(dtype)
    if strided and m.dim():
        m = torch.stack([m, m], dim=-1)[..., 1]
    codec = get_codec("bitmask")
    p = codec.compress(m)
    assert p.nbytes == codec.compressed_nbytes(m.shape, m.dtype) == -(-m.numel() // 8)
    assert_bitwise_equal(codec.decompress(p), m.contiguous())


@settings(max_examples=30, deadline=None)
@given(x=tensors())
def test_keep_is_identity(x):
    codec = get_codec("keep")
    p = codec.compress(x)
    assert codec.decompress(p) is x
    assert p.nbytes == x.untyped_storage().nbytes()
