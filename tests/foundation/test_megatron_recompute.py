"""megatron-core's own recompute modes on CPU give bit-identical gradients to no recompute, dropout on."""

import pytest
import torch

from megatron_adacc.testing import build_tiny_gpt, loss_and_grads, tiny_batch

MODES = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective-core_attn": dict(recompute_granularity="selective"),
    "selective-layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "selective-all-nobias": dict(recompute_granularity="selective",
                                 recompute_modules=["core_attn", "layernorm", "mlp"], add_bias_linear=False),
}


@pytest.fixture(scope="module")
def batch():
    return tiny_batch()


def _reference(batch, **overrides):
    bias = overrides.get("add_bias_linear", True)
    return loss_and_grads(build_tiny_gpt(seed=1, add_bias_linear=bias), batch)


@pytest.mark.parametrize("mode", list(MODES))
def test_recompute_is_bit_identical(mode, batch):
    ref_loss, ref_grads = _reference(batch, **MODES[mode])
    loss, grads = loss_and_grads(build_tiny_gpt(seed=1, **MODES[mode]), batch)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_dropout_is_really_on(batch):
    """Guards the test above: with another dropout seed the gradients differ, so equality means replay."""
    _, g1 = loss_and_grads(build_tiny_gpt(seed=1), batch, rng_seed=7)
    _, g2 = loss_and_grads(build_tiny_gpt(seed=1), batch, rng_seed=8)
    assert any(not torch.equal(g1[n], g2[n]) for n in g1)
