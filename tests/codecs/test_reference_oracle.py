"""The reference itself against hand-computed cases (it is the oracle of every other test)."""

from __future__ import annotations

import torch

from megatron_adacc.codecs import reference


def test_symmetric_hand_case():
    # S = max(3.5 / 7, 2 / 8) = 0.5; codes round(x / S) = [2, -4, 7, 0] -> nibbles [10, 4, 15, 8].
    x = torch.tensor([1.0, -2.0, 3.5, 0.0])
    payload, scales, bad = reference.sym_int4_compress(x, 4)
    assert scales.tolist() == [0.5]
    assert payload.tolist() == [10 | (4 << 4), 15 | (8 << 4)]
    assert bad.tolist() == [0]
    out = torch.empty(4)
    reference.sym_int4_decompress(payload, scales, 4, out)
    assert out.tolist() == [1.0, -2.0, 3.5, 0.0]


def test_symmetric_negative_extreme_uses_the_papers_scale():
    # The extreme value is negative: S = 8 / 8 = 1 exactly as in Adacc eq. 2, and -8 is representable.
    payload, scales, _ = reference.sym_int4_compress(torch.tensor([-8.0, 7.0, 0.4, 0.6]), 4)
    assert scales.tolist() == [1.0]
    assert payload.tolist() == [0 | (15 << 4), 8 | (9 << 4)]  # codes -8, 7, 0 (0.4), 1 (0.6)


def test_round_half_to_even_and_odd_group_padding():
    # group 3: bytes per group ceil(3/2) = 2; the padding nibble of each group is 0.
    x = torch.tensor([0.5, 1.5, 7.0, -8.0, 2.5, 0.0])
    payload, scales, _ = reference.sym_int4_compress(x, 3)
    assert scales.tolist() == [1.0, 1.0]
    # codes: round(0.5)=0, round(1.5)=2, 7 | -8, round(2.5)=2, 0
    assert payload.tolist() == [8 | (10 << 4), 15, 0 | (10 << 4), 8]


def test_asymmetric_corrected_range_hand_case():
    # min 0, max 1.5: S = 1.5 / 15 = 0.1, O = 0 + 8 * 0.1 = 0.8; max maps to code 7, min to -8 (paper: clips).
    x = torch.tensor([0.0, 1.5, 1.0, 0.1])
    payload, scales, offsets, _ = reference.asym_int4_compress(x, 4)
    assert torch.allclose(scales, torch.tensor([0.1])) and torch.allclose(offsets, torch.tensor([0.8]))
    codes = reference.unpack_groups(payload, 4, 4, 4).reshape(-1) - 8
    assert codes.tolist() == [-8, 7, 2, -7]


def test_constant_group_is_exact_in_asymmetric():
    x = torch.full((10,), -3.25)
    payload, scales, offsets, _ = reference.asym_int4_compress(x, 10)
    out = torch.empty(10)
    reference.asym_int4_decompress(payload, scales, offsets, 10, out)
    assert scales.tolist() == [0.0] and torch.equal(out, x)


def test_bitmask_bit_order_is_little_endian():
    x = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    payload, bad = reference.bitmask_pack(x)
    assert payload.tolist() == [0b1000_0001, 0b11] and bad.tolist() == [0]


def _fmix32_py(h: int) -> int:
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_uniform24_matches_plain_integer_arithmetic():
    seed = 0x0123_4567_89AB_CDEF
    index = torch.tensor([0, 1, 2, 2**32 - 1, 2**32, 2**40 + 12345, 2**62 + 7])
    got = reference.uniform24(seed, index).tolist()
    for i, value in zip(index.tolist(), got):
        a = _fmix32_py((i & 0xFFFFFFFF) ^ (seed & 0xFFFFFFFF))
        b = _fmix32_py((a + ((i >> 32) ^ (seed >> 32))) & 0xFFFFFFFF)
        assert value == b >> 8


def test_uniform24_is_uniform_enough():
    u = reference.uniform24(99, torch.arange(1 << 16)).double() / 2**24
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = (1 << 16) / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.0  # 15 degrees of freedom: P(chi2 > 45) < 1e-4 for a uniform stream


def test_stochastic_hand_case_with_known_uniforms():
    # 2 bits over [0, 3]: S = 1; x = 1.25 rounds up iff u < 0.25.
    x = torch.tensor([0.0, 3.0, 1.25, 1.25])
    payload, mins, scales, _ = reference.stochastic_compress(x, 4, 2, seed=5)
    u = reference.uniform24(5, torch.arange(4)).float() * 2.0**-24
    expected = [0, 3] + [1 + int(u[i] < 0.25) for i in (2, 3)]
    assert reference.unpack_groups(payload, 4, 4, 2).reshape(-1).tolist() == expected
    assert mins.tolist() == [0.0] and scales.tolist() == [1.0]


def test_select_outlier_channels():
    sums = torch.tensor([1.0] * 20 + [100.0], dtype=torch.float64)
    assert reference.select_outlier_channels(sums, 3.0).tolist() == [20]
    # Sums equal up to rounding noise: no outliers whatever the Z-scores of the noise say.
    noisy = torch.full((50,), 0.1, dtype=torch.float64) + torch.arange(50) * 1e-18
    assert reference.select_outlier_channels(noisy, 3.0).numel() == 0
    assert reference.select_outlier_channels(torch.zeros(8, dtype=torch.float64), 3.0).numel() == 0


def test_top_outlier_channels_holds_the_exact_selection_within_its_capacity():
    torch.manual_seed(0)
    sums = torch.rand(64, dtype=torch.float64)
    sums[[5, 40, 17]] = torch.tensor([90.0, 60.0, 30.0], dtype=torch.float64)
    exact = reference.select_outlier_channels(sums, 3.0).tolist()
    for capacity in (len(exact), 5, 64, 99):
        idx, count = reference.top_outlier_channels(sums, 3.0, capacity)
        assert int(count) == len(exact) and idx.dtype == torch.int32
        assert idx.tolist() == sorted(idx.tolist()) and len(set(idx.tolist())) == min(capacity, 64)
        assert set(exact) <= set(idx.tolist())
    idx, count = reference.top_outlier_channels(sums, 3.0, 1)  # over capacity: the largest Z-score is kept
    assert idx.tolist() == [5] and int(count) == len(exact)
    for alike in (torch.zeros(8, dtype=torch.float64), torch.full((50,), 0.1, dtype=torch.float64)):
        assert int(reference.top_outlier_channels(alike, 3.0, 2)[1]) == 0  # as select_outlier_channels
    assert reference.top_outlier_channels(sums[:1], 3.0, 4)[0].numel() == 0


def test_outlier_codec_at_a_capacity_stores_every_outlier_and_reads_nothing():
    from codec_test_utils import activation_like

    from megatron_adacc.codecs import get_codec
    from megatron_adacc.testing.syncs import HostSyncs

    codec = get_codec("int4_outlier")
    x = activation_like((4, 16, 96), torch.float32)  # channels 0 and 1 are 30x larger
    exact = codec.compress(x)
    assert exact.tensors["index"].tolist() == [0, 1]
    with HostSyncs() as syncs:
        packed = codec.compress(x, capacity=5)
        # reference kernels only: the compiled CPU kernel checks the indices on host memory (see the sync test)
        reference.get_codec("int4_outlier").compress(x, capacity=5)
    assert [s for s in syncs.events if "_backend.py" not in s.site] == []
    assert int(packed.found["outlier_channels"]) == 2 and packed.tensors["index"].numel() == 5
    assert {0, 1} <= set(packed.tensors["index"].tolist())
    y, y_exact = codec.decompress(packed), codec.decompress(exact)
    assert torch.equal(y[..., :2], x[..., :2])  # the outliers exactly, as the exact selection stores them
    assert (y - x).abs().max() <= (y_exact - x).abs().max()  # the other stored channels are exact too
    assert packed.nbytes == codec.compressed_nbytes(x.shape, x.dtype, num_outliers=5)


def test_a_channel_exactly_at_the_threshold_is_no_outlier_whatever_the_summation_order():
    """With two channels every Z-score is exactly -1 or 1; rounding made some 1 + ulp, and the compiled sums and
    the reference's (other addition orders) then disagreed on whether the channel is an outlier at z = 1."""
    from megatron_adacc.codecs.reference import select_outlier_channels, top_outlier_channels

    g = torch.Generator().manual_seed(0)
    for _ in range(1000):
        sums = torch.rand(2, generator=g, dtype=torch.float64) * 10.0 ** float(torch.randint(-5, 5, (), generator=g))
        assert select_outlier_channels(sums, 1.0).numel() == 0, sums
        assert int(top_outlier_channels(sums, 1.0, 2)[1]) == 0, sums
