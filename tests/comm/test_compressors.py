"""Compressors against hand-computed small cases."""

from __future__ import annotations

import pytest
import torch

from megatron_adacc.comm.compressors import (
    DGCCompressor,
    NoneCompressor,
    QSGDCompressor,
    TopKCompressor,
    build_compressor,
)
from megatron_adacc.comm.compressors.topk import k_for


def test_k_for_rounds_up_and_keeps_one():
    assert k_for(100, 0.01) == 1
    assert k_for(101, 0.01) == 2
    assert k_for(3, 0.0001) == 1
    assert k_for(10, 1.0) == 10
    assert k_for(30, 0.1) == 3  # 0.1 * 30 is 3.0000000000000004 in floating point


def test_topk_hand_case():
    g = torch.tensor([[1.0, -5.0, 3.0], [0.5, -2.0, 4.0]])
    c = TopKCompressor(density=0.5)  # k = ceil(0.5 * 6) = 3 -> -5, 4, 3
    values, indices = c.compress(g)
    order = indices.argsort()
    assert indices[order].tolist() == [1, 2, 5]
    assert values[order].tolist() == [-5.0, 3.0, 4.0]
    assert indices.dtype == torch.int32
    assert torch.equal(c.decompress([values, indices], g), torch.tensor([[0.0, -5.0, 3.0], [0.0, 0.0, 4.0]]))
    assert [s.numel for s in c.layout(6, torch.float32)] == [3, 3]


def test_topk_residual_is_exactly_the_unsent_entries():
    g = torch.randn(7, 5)
    c = TopKCompressor(0.2)
    payload = c.compress(g)
    residual = g.clone()
    c.decompress_add(payload, residual, alpha=-1.0)
    sent = torch.zeros(35, dtype=torch.bool)
    sent[payload[1].long()] = True
    assert torch.equal(residual.view(-1)[sent], torch.zeros(int(sent.sum())))
    assert torch.equal(residual.view(-1)[~sent], g.view(-1)[~sent])


def test_decompress_add_scales():
    g = torch.tensor([0.0, 2.0, -1.0])
    c = TopKCompressor(0.34)  # k = 2 -> 2, -1
    out = torch.ones(3)
    c.decompress_add(c.compress(g), out, alpha=0.5)
    assert out.tolist() == [1.0, 2.0, 0.5]


def test_dgc_with_whole_tensor_sample_equals_topk():
    g = torch.tensor([0.1, -7.0, 3.0, 0.2, -2.0, 5.0, 0.0, 1.0])
    c = DGCCompressor(density=0.25, min_sample=64)  # 8 < 64: the sample is the whole tensor, k = 2
    values, indices = c.compress(g)
    assert sorted(indices.tolist()) == [1, 5]
    assert sorted(values.tolist()) == [-7.0, 5.0]


class _FixedSampleDGC(DGCCompressor):
    def __init__(self, picked, **kw):
        super().__init__(**kw)
        self.picked = torch.tensor(picked)

    def sample_indices(self, numel, device):
        return self.picked


def test_dgc_threshold_too_high_pads_with_zeros():
    # Sample = entries {1, 5} -> |.| = {7, 5}; k_sample = ceil(0.5 * 2) = 1 -> threshold 7: one entry passes,
    # but k = ceil(0.5 * 8) = 4, so three slots are padding (index 0, value 0).
    g = torch.tensor([0.1, -7.0, 3.0, 0.2, -2.0, 5.0, 0.0, 1.0])
    c = _FixedSampleDGC([1, 5], density=0.5)
    values, indices = c.compress(g)
    assert values.tolist() == [-7.0, 0.0, 0.0, 0.0]
    assert indices.tolist() == [1, 0, 0, 0]
    expected = torch.zeros(8)
    expected[1] = -7.0
    assert torch.equal(c.decompress([values, indices], g), expected)


def test_dgc_threshold_too_low_keeps_k_largest():
    # Sample {6, 0} -> |.| = {0, 0.1}; threshold 0.1 passes 7 entries; only the k = 2 largest are sent.
    g = torch.tensor([0.1, -7.0, 3.0, 0.2, -2.0, 5.0, 0.0, 1.0])
    c = _FixedSampleDGC([6, 0], density=0.25)
    values, indices = c.compress(g)
    assert sorted(indices.tolist()) == [1, 5]


def test_qsgd_exact_levels_hand_case():
    # ||x|| = 5, s = 5: s |x| / ||x|| = (3, 4) are integers, so no randomness: levels (3, -4).
    x = torch.tensor([3.0, -4.0])
    c = QSGDCompressor(levels=5)
    norm, levels = c.compress(x)
    assert norm.tolist() == [5.0]
    assert levels.tolist() == [3, -4] and levels.dtype == torch.int8
    assert torch.allclose(c.decompress([norm, levels], x), x)


def test_qsgd_is_unbiased_and_bounded():
    torch.manual_seed(0)
    x = torch.randn(64)
    c = QSGDCompressor(levels=4, seed=3)
    draws = torch.stack([c.decompress(c.compress(x), x) for _ in range(4000)])
    # Each draw lies on the grid next to x: |Q(x) - x| <= ||x|| / s.
    assert (draws - x).abs().max() <= x.norm() / 4 + 1e-6
    # Unbiased: the mean of 4000 draws is within 5 standard errors of x.
    stderr = (x.norm() / 4) / 2 / 4000**0.5
    assert (draws.mean(0) - x).abs().max() < 5 * stderr


def test_qsgd_zero_tensor_and_generator_state_roundtrip():
    c = QSGDCompressor(8, seed=1)
    assert c.decompress(c.compress(torch.zeros(5)), torch.zeros(5)).abs().sum() == 0
    x = torch.randn(100)
    state = c.state_dict()
    first = c.compress(x)[1]
    c.load_state_dict(state)
    assert torch.equal(c.compress(x)[1], first)


def test_none_compressor_is_identity_and_allreducible():
    x = torch.randn(3, 4)
    c = NoneCompressor()
    assert c.supports_allreduce
    assert torch.equal(c.decompress(c.compress(x), x), x)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: TopKCompressor(0.0), "density"),
        (lambda: DGCCompressor(1.5), "density"),
        (lambda: QSGDCompressor(200), "levels"),
        (lambda: build_compressor("powersgd"), "unknown gradient compressor"),
    ],
)
def test_bad_arguments_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.parametrize("make", [lambda: QSGDCompressor(8, seed=2), lambda: DGCCompressor(0.1, min_sample=4, seed=2)],
                         ids=["qsgd", "dgc"])
def test_random_draws_are_made_on_the_gradients_device_and_resume_there(make):
    x = torch.randn(300)
    c = make()
    assert c.state_dict()["generator"] is None  # no generator before the first gradient: its device is unknown
    c.compress(x)
    state = c.state_dict()
    assert state["device"] == "cpu"
    first = c.compress(x)
    again = make()
    again.load_state_dict({"generator": state["generator"]})  # a checkpoint from before devices were recorded
    assert all(torch.equal(a, b) for a, b in zip(again.compress(x), first))
    elsewhere = make()
    elsewhere.load_state_dict({**state, "device": "cuda:0"})
    with pytest.raises(ValueError, match="saved on cuda:0"):
        elsewhere.compress(x)
