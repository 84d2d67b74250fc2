"""GACT's stochastic quantizer: unbiased, variance within GACT's bound, reproducible from a generator."""

from __future__ import annotations

import pytest
import torch
from codec_test_utils import assert_packed_equal

from megatron_adacc.codecs import get_codec, reference

N_DRAWS = 4000


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unbiased_over_many_independent_draws(bits):
    # One 64-value group repeated N_DRAWS times: each copy is its own group with its own random numbers
    # (the counter-based stream is indexed by position), so the copies are N_DRAWS independent
    # quantizations of the same values.
    base = torch.linspace(-1.3, 2.1, 64) + 0.01 * torch.randn(64)
    codec = get_codec("stochastic", bits=bits, group_size=64)
    p = codec.compress(base.repeat(N_DRAWS), generator=torch.Generator().manual_seed(bits))
    draws = codec.decompress(p).view(N_DRAWS, 64).double()
    step = (base.max() - base.min()).item() / (2**bits - 1)
    mean_err = (draws.mean(0) - base.double()).abs()
    # Each draw has standard deviation <= step / 2, so the mean of N_DRAWS has <= step / (2 sqrt(N)).
    # Tolerance: 5 standard deviations (a false alarm has probability < 64 * 6e-7 per run) plus the
    # 2**-24 granularity of the uniforms.
    tolerance = 5 * step / (2 * N_DRAWS**0.5) + step * 2.0**-23
    assert (mean_err <= tolerance).all(), (mean_err / tolerance).max()
    # The test can fail: deterministic rounding to nearest is biased far beyond this tolerance.
    nearest = torch.round((base - base.min()) / step) * step + base.min()
    assert ((nearest - base).abs().double() > tolerance).sum() > 32
    # Variance bound of GACT appendix A.4: Var[Q(h)_j] <= step**2 / 4.
    assert (draws.var(0) <= step**2 / 4 * 1.2).all()


def test_unbiased_across_generator_seeds():
    x = torch.tensor([0.1, 0.37, 0.5, 0.99, -0.25, 0.0, 1.0, 0.731])
    codec = get_codec("stochastic", bits=2, group_size=8)
    total = torch.zeros(8, dtype=torch.float64)
    n = 1500
    for seed in range(n):
        total += codec.decompress(codec.compress(x, generator=torch.Generator().manual_seed(seed))).double()
    step = 1.25 / 3
    assert ((total / n - x.double()).abs() <= 5 * step / (2 * n**0.5)).all()


def test_generator_makes_it_reproducible_and_seeds_differ():
    x = torch.randn(10_000)
    codec = get_codec("stochastic", bits=2)
    a = codec.compress(x, generator=torch.Generator().manual_seed(42))
    b = codec.compress(x, generator=torch.Generator().manual_seed(42))
    c = codec.compress(x, generator=torch.Generator().manual_seed(43))
    assert_packed_equal(a, b)
    assert not torch.equal(a.tensors["payload"], c.tensors["payload"])
    torch.manual_seed(5)
    d = codec.compress(x)
    torch.manual_seed(5)
    e = codec.compress(x)
    assert_packed_equal(d, e)  # the default generator follows torch.manual_seed


def test_error_at_most_one_step_and_codes_in_range():
    x = torch.randn(3000) * 4
    for bits in (1, 2, 4, 8):
        codec = get_codec("stochastic", bits=bits, group_size=100)
        p = codec.compress(x)
        s = p.tensors["scales"].repeat_interleave(100)
        assert ((x - codec.decompress(p)).abs() <= s * (1 + 1e-5)).all()
        codes = reference.unpack_groups(p.tensors["payload"], 3000, 100, bits)
        assert int(codes.max()) <= 2**bits - 1


def test_group_extremes_are_exact():
    # T is exactly 0 at the minimum and 2**b - 1 at the maximum: no randomness there.
    x = torch.randn(50, 64)
    codec = get_codec("stochastic", bits=4, group_size=64)
    y = codec.decompress(codec.compress(x)).view(50, 64)
    rows = torch.arange(50)
    assert torch.equal(y[rows, x.argmin(1)], x.min(1).values)
    assert torch.allclose(y[rows, x.argmax(1)], x.max(1).values, rtol=1e-6, atol=0)
