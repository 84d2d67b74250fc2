"""Every compiled kernel entry point, run on the test device, equals the pure-torch reference bit for bit.

The device is ``ADACC_TEST_DEVICE`` (default ``cpu``; see conftest.py). With ``cuda`` this module is the
exactness check of the CUDA kernels that ``scripts/gpu_acceptance.sh`` runs; their per-value arithmetic is the
CPU kernels' own (csrc/codec_math.h). The reference always runs on the CPU, and the kernels are called on
``megatron_adacc._C`` itself, so no call can fall back to the reference unnoticed.
"""

from __future__ import annotations

import pytest
import torch
from codec_test_utils import EXT, activation_like, assert_bitwise_equal

from megatron_adacc.codecs import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (7, 13), (33, 1000), (515, 7)]


def _same(mine: tuple, theirs: tuple) -> None:
    for a, b in zip(mine, theirs, strict=True):
        assert_bitwise_equal(a.cpu(), b)


def _round_trip(name: str, x: torch.Tensor, device: torch.device, *args: int, seed: int | None = None) -> None:
    """``name``_compress(x, *args[, seed]) and ``name``_decompress(outputs but the flag, *args, out) on the
    device, each against the reference on the CPU."""
    compress_args = (*args, seed) if seed is not None else args
    mine = getattr(EXT, f"{name}_compress")(x.to(device), *compress_args)
    theirs = getattr(reference, f"{name}_compress")(x, *compress_args)
    _same(mine, theirs)
    decode_args = args
    y = torch.empty_like(x, device=device)
    getattr(EXT, f"{name}_decompress")(*mine[:-1], *decode_args, y)
    y_ref = torch.empty_like(x)
    getattr(reference, f"{name}_decompress")(*theirs[:-1], *decode_args, y_ref)
    assert_bitwise_equal(y.cpu(), y_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("group", [1, 7, 64, 1000])
def test_grouped_kernels(device, dtype, shape, group):
    x = activation_like(shape, dtype).reshape(-1)
    _round_trip("sym_int4", x, device, group)
    _round_trip("asym_int4", x, device, group)
    for bits in (1, 2, 4, 8):
        _round_trip("stochastic", x, device, group, bits, seed=0x9E3779B97F4A7C15 >> bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rowwise_kernels(device, dtype, shape):
    x = activation_like(shape, dtype)
    _round_trip("chan_int4", x, device)
    sums = EXT.channel_abs_sum(x.to(device)).cpu()
    # Same chunked order on every device: the CPU kernel's sums exactly, the reference's to rounding.
    assert_bitwise_equal(sums, EXT.channel_abs_sum(x))
    assert torch.allclose(sums, reference.channel_abs_sum(x), rtol=1e-12, atol=0)
    idx = reference.select_outlier_channels(reference.channel_abs_sum(x), 1.0)
    mine = EXT.outlier_int4_compress(x.to(device), idx.to(device))
    theirs = reference.outlier_int4_compress(x, idx)
    _same(mine, theirs)
    y = torch.empty_like(x, device=device)
    EXT.outlier_int4_decompress(*mine[:3], idx.to(device), y)
    y_ref = torch.empty_like(x)
    reference.outlier_int4_decompress(*theirs[:3], idx, y_ref)
    assert_bitwise_equal(y.cpu(), y_ref)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8], ids=str)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001, 100_003])
def test_bitmask_kernels(device, n, dtype):
    m = (torch.rand(n) < 0.3).to(dtype)
    mine, theirs = EXT.bitmask_pack(m.to(device)), reference.bitmask_pack(m)
    _same(mine, theirs)
    out = torch.empty_like(m, device=device)
    EXT.bitmask_unpack(mine[0], out)
    assert_bitwise_equal(out.cpu(), m)
    not_a_mask = m.to(torch.uint8)
    not_a_mask[n // 2] = 2  # in the short last byte for some n, in a full one for others
    assert EXT.bitmask_pack(not_a_mask.to(device))[1].item() == reference.bitmask_pack(not_a_mask)[1].item() == 1


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_value_in_an_outlier_channel_is_flagged(device, bad_value):
    # The dense rows have their outlier channels zeroed; a NaN or Inf there must be reported all the same.
    x = activation_like((16, 32), torch.float32)
    x[5, 1] = bad_value
    idx = torch.tensor([0, 1], dtype=torch.int32)
    assert reference.outlier_int4_compress(x, idx)[-1].item() == 1
    assert EXT.outlier_int4_compress(x.to(device), idx.to(device))[-1].item() == 1


@pytest.mark.parametrize("group", [1, 8, 1000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_finite_half_precision_value(device, isa, dtype, group):
    # All 16-bit patterns that are finite values (subnormals and signed zeros included), shuffled so that
    # groups mix magnitudes: every value is widened, and decoded values of every magnitude narrowed, by the
    # kernels' vector conversions (F16C, bfloat16 shifts) and their scalar tails.
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x.float())]
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(16))]
    _round_trip("sym_int4", x, device, group)
    _round_trip("asym_int4", x, device, group)
    _round_trip("stochastic", x, device, group, 4, seed=24)
