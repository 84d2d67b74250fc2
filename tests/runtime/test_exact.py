"""Exact policies give bit-identical losses and gradients on a real megatron-core GPT with dropout on.

keep == stock Megatron without recompute; all-recompute == Megatron full recompute; every single-op recompute
and mixed keep/recompute policies (different in every layer) == stock. Recomputation replays the dropout masks
from the saved RNG states, so equality is exact, not approximate.
"""

import random

import pytest
import torch
from _runtime_helpers import decisions, grads_equal, megatron_full_recompute, policy_of

import megatron_adacc
from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.runtime.checkpoint import checkpointed_layer_forward
from megatron_adacc.testing import loss_and_grads
from megatron_adacc.training.distributed import set_seed


@pytest.fixture(scope="module")
def reference(model, batch):
    megatron_adacc.uninstall()
    return loss_and_grads(model, batch)


def _with_policy(model, batch, policy):
    megatron_adacc.install(model.config, policy)
    try:
        return loss_and_grads(model, batch)
    finally:
        megatron_adacc.uninstall()


def test_all_keep_equals_stock_megatron(model, batch, reference):
    loss, grads = _with_policy(model, batch, Policy.all_keep(2))
    assert torch.equal(loss, reference[0])
    assert grads_equal(grads, reference[1]) == []


def test_all_recompute_equals_megatron_full_recompute(model, batch):
    full = megatron_full_recompute(model, batch)
    loss, grads = _with_policy(model, batch, "recompute")
    assert torch.equal(loss, full[0])
    assert grads_equal(grads, full[1]) == []


@pytest.mark.parametrize("op", OP_NAMES[1:])  # every op but the layer input, the checkpoint
def test_single_op_recompute_is_bit_identical(model, batch, reference, op):
    loss, grads = _with_policy(model, batch, policy_of([decisions(recompute=(op,))] * 2))
    assert torch.equal(loss, reference[0])
    assert grads_equal(grads, reference[1]) == []


def test_recompute_of_the_first_op_and_whole_layer_at_layer_level(model, batch):
    """Recomputing input_layernorm alone, or every op but the layer input (the checkpoint, which the runtime
    refuses to recompute), is exact: the latter is Megatron's full recompute of one layer."""
    layer = model.decoder.layers[0]
    mask = batch[2]
    x0 = torch.randn(32, 2, 64)

    def run(fn):
        x = x0.clone().requires_grad_(True)
        set_seed(4)
        layer.zero_grad(set_to_none=True)
        out = fn(x)
        (out ** 2).sum().backward()
        return [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]

    ref = run(lambda x: layer(hidden_states=x, attention_mask=mask)[0])
    for recompute in (("input_layernorm",), OP_NAMES[1:]):
        chosen = decisions(recompute=recompute)
        got = run(lambda x, chosen=chosen: checkpointed_layer_forward(layer, chosen, x, mask))
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), recompute
    with pytest.raises(ValueError, match="'layer_input' is the layer's checkpoint"):
        run(lambda x: checkpointed_layer_forward(layer, decisions(recompute=OP_NAMES), x, mask))


@pytest.mark.parametrize("seed", range(6))
def test_random_keep_recompute_mixes_per_layer(model, batch, reference, seed):
    rng = random.Random(seed)
    layers = [decisions(recompute=[n for n in OP_NAMES[1:] if rng.random() < 0.5]) for _ in range(2)]
    assert layers[0] != layers[1] or seed > 0
    loss, grads = _with_policy(model, batch, policy_of(layers))
    assert torch.equal(loss, reference[0])
    assert grads_equal(grads, reference[1]) == []


def test_recompute_really_replays_dropout(model, batch, reference):
    """Guards the tests above: recomputing under another RNG state gives different gradients, so equality means
    the saved RNG states were restored."""
    from megatron_adacc.adacc.runtime import checkpoint

    original = checkpoint._replay_rng
    checkpoint._replay_rng = lambda states: original(None)  # re-run with whatever state is current
    try:
        _, grads = _with_policy(model, batch, policy_of([decisions(recompute=("dropout", "self_attn_bda"))] * 2))
    finally:
        checkpoint._replay_rng = original
    assert grads_equal(grads, reference[1]) != []
