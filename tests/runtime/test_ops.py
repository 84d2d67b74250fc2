"""The 14-op decomposition reproduces megatron-core's TransformerLayer forward and backward bit for bit."""

import pytest
import torch

from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS_BY_NAME
from megatron_adacc.adacc.runtime.ops import DATAFLOWS, PRODUCER, initial_env, layer_ops, run_ops, segment_inputs
from megatron_adacc.testing import build_tiny_gpt
from megatron_adacc.training.distributed import set_seed

VARIANTS = {
    "default": {},
    "rmsnorm-swiglu-gqa-nobias": dict(normalization="RMSNorm", gated_linear_unit=True,
                                      activation_func=torch.nn.functional.silu, add_bias_linear=False,
                                      num_query_groups=2),
    "fused-gelu": dict(bias_activation_fusion=True),
}


def _run_layer(layer, fn, x0, mask):
    x = x0.clone().requires_grad_(True)
    set_seed(11)
    layer.zero_grad(set_to_none=True)
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ops_match_layer_forward_and_backward(variant, batch):
    model = build_tiny_gpt(seed=3, **VARIANTS[variant])
    model.train()
    layer = model.decoder.layers[1]
    mask = batch[2]
    x0 = torch.randn(32, 2, 64)
    ref = _run_layer(layer, lambda x: layer(hidden_states=x, attention_mask=mask)[0], x0, mask)
    ops = _run_layer(layer, lambda x: run_ops(layer_ops(layer), initial_env(x, mask))["output"], x0, mask)
    assert torch.equal(ref[0], ops[0])
    assert torch.equal(ref[1], ops[1])
    for name in ref[2]:
        assert torch.equal(ref[2][name], ops[2][name]), name


def test_dropout_changes_the_output(batch):
    """Guards the test above: the layer really draws random numbers (a different seed, a different output)."""
    layer = build_tiny_gpt(seed=3).decoder.layers[0]
    layer.train()
    x = torch.randn(32, 2, 64)
    set_seed(1)
    a = layer(hidden_states=x, attention_mask=batch[2])[0]
    set_seed(2)
    b = layer(hidden_states=x, attention_mask=batch[2])[0]
    assert not torch.equal(a, b)


def test_op_table_names_and_dataflow():
    layer = build_tiny_gpt(seed=3).decoder.layers[0]
    ops = layer_ops(layer)
    assert tuple(op.name for op in ops) == OP_NAMES
    # Every input is a layer input or an output of an earlier op.
    produced = {"hidden_states", "attention_mask", "rotary_pos_emb"}
    for op in ops:
        assert set(op.inputs) <= produced, op.name
        produced |= set(op.outputs)
    assert PRODUCER["probs_dropped"] == "dropout" and PRODUCER["output"] == "mlp_bda"
    assert PRODUCER["hidden_states"] == "layer_input"  # the layer input is the first op's output
    # A segment's stored inputs are what it reads from outside itself.
    assert segment_inputs(ops[3:7]) == ("query", "key", "attention_mask", "value")
    assert segment_inputs(ops[8:10]) == ("proj_out", "proj_bias", "hidden_states")
    assert segment_inputs(ops[1:]) == ("hidden_states", "rotary_pos_emb", "attention_mask")  # full recompute


@pytest.mark.parametrize("kind", sorted(DATAFLOWS))
def test_the_cost_model_knows_every_read_past_the_op_before(kind):
    """A recompute segment re-runs from every output it reads, so the cost model must know which ops read past the
    op before them (a segment reading what another recomputes re-runs that one too): the op table's reads are
    exactly the declared ones, for each attention."""
    flow = DATAFLOWS[kind]
    assert {name: flow.reads_past(name) for name in OP_NAMES} == {name: OPS_BY_NAME[name].reads for name in OP_NAMES}
