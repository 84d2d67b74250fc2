"""Compress policies: the forward is exact, gradients stay within stated bounds, 50 training steps stay finite
and track the uncompressed run."""

import math

import pytest
import torch
from _runtime_helpers import decisions, policy_of

import megatron_adacc
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.runtime.checkpoint import MASK_CODEC, MaskCodec
from megatron_adacc.testing import build_tiny_gpt, grad_rel_error, loss_and_grads
from megatron_adacc.training.data import BatchSampler
from megatron_adacc.training.distributed import set_seed

#: Global relative gradient error ||g - g_ref|| / ||g_ref|| after one step, measured 0.055 (quantize-all) and
#: 0.052 (layer-specific codecs) on this model and batch; the bound leaves room for other seeds and kernels.
GRAD_REL_BOUND = 0.12

POLICIES = {
    "quantize-all": lambda: Policy.quantize_all(2),
    "layer-specific": lambda: Policy.uniform("compress", 2, name="layer-specific"),
    "mixed-per-layer": lambda: policy_of([
        decisions(recompute=("scores", "softmax", "dropout"), compress={"linear_fc1": "int4_outlier",
                                                                      "activation": "int4_outlier"}),
        decisions(compress={"linear_qkv": "int4_channelwise", "softmax": "int4_asymmetric",
                            "dropout": "bitmask"}, recompute=("context", "linear_proj", "self_attn_bda")),
    ]),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_one_step_forward_exact_gradients_bounded(model, batch, name):
    ref_loss, ref_grads = loss_and_grads(model, batch)
    megatron_adacc.install(model.config, POLICIES[name](), predict_memory=False)
    loss, grads = loss_and_grads(model, batch)
    # Compression only changes what backward reads, never the forward.
    assert torch.equal(loss, ref_loss)
    err = grad_rel_error(grads, ref_grads)
    assert 0 < err < GRAD_REL_BOUND
    assert all(torch.isfinite(g).all() for g in grads.values())


def _train(policy, steps=50):
    m = build_tiny_gpt(seed=5)
    m.train()
    if policy is not None:
        megatron_adacc.install(m.config, policy, predict_memory=False)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    sampler = BatchSampler(32, 4, seed=0)
    set_seed(9)
    losses = []
    for _ in range(steps):
        b = next(sampler)
        opt.zero_grad()
        loss = m(b.tokens, b.position_ids, b.attention_mask, labels=b.labels).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    megatron_adacc.uninstall()
    return losses


@pytest.fixture(scope="module")
def uncompressed_losses():
    return _train(None)


@pytest.mark.parametrize("name", ["quantize-all", "layer-specific"])
def test_fifty_steps_finite_and_close_to_uncompressed(name, uncompressed_losses):
    losses = _train(POLICIES[name]())
    assert all(math.isfinite(v) for v in losses)
    tail, ref_tail = sum(losses[-10:]) / 10, sum(uncompressed_losses[-10:]) / 10
    # Trained: the loss fell by more than a third, like the uncompressed run; and the last ten steps average
    # within 10% of the uncompressed run's (measured differences: 2-6%).
    assert tail < 0.67 * losses[0]
    assert abs(tail - ref_tail) < 0.10 * ref_tail


def test_float_dropout_mask_is_stored_losslessly_in_bits():
    set_seed(0)
    x = torch.ones(1000)
    mask = torch.nn.functional.dropout(x, p=0.1, training=True)  # CPU dropout: values 0 or 1/0.9
    scale = MaskCodec.float_mask_scale(mask)
    assert scale == pytest.approx(1 / 0.9)
    packed = MASK_CODEC.compress(mask, scale)
    assert packed.nbytes == 125  # one bit per value
    assert torch.equal(MASK_CODEC.decompress(packed), mask)
    assert MaskCodec.float_mask_scale(torch.tensor([0.0, 1.0, 2.0])) is None
    assert MaskCodec.float_mask_scale(torch.tensor([0.0, -1.0, -1.0])) is None  # not a dropout multiplier
    assert MaskCodec.float_mask_scale(torch.zeros(8)) is None
    assert MaskCodec.float_mask_scale(torch.zeros(0)) is None
    bools = torch.rand(77) < 0.5
    assert torch.equal(MASK_CODEC.decompress(MASK_CODEC.compress(bools)), bools)
