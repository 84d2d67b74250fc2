"""The MLP re-run in token tiles (``Decision.recompute(tiles=T)`` on linear_fc1, activation and linear_fc2).

Against the untiled re-run of the same policy on a real megatron-core GPT with dropout on: the loss and every
gradient equal up to float rounding (a thin tile's matrix products may take another kernel path, and the MLP's
weight gradients are summed over the tiles); the bytes held for backward are measured as predicted; a
parameter's accumulation hook, which Megatron DDP counts, runs once. Policy files and decisions refuse a tiling
the runtime cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from _runtime_helpers import decisions, grads_equal, policy_of

import megatron_adacc
from megatron_adacc.adacc.policy.io import PolicySchemaError, policy_from_json, policy_to_json
from megatron_adacc.adacc.policy.ops import OP_NAMES, TILED_OPS
from megatron_adacc.adacc.policy.policy import Decision, Policy
from megatron_adacc.adacc.runtime import checkpointed_layer_forward, memory_report
from megatron_adacc.adacc.runtime.tiled import tile_slices
from megatron_adacc.testing import loss_and_grads

MLP_WEIGHTS = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight")


def tiled(chosen: dict[str, Decision], tiles: int) -> dict[str, Decision]:
    return {**chosen, **{name: Decision.recompute(tiles) for name in TILED_OPS}}


def _run(model, batch, layers):
    megatron_adacc.install(model.config, policy_of(layers))
    try:
        loss, grads = loss_and_grads(model, batch)
        return loss, grads, memory_report()["layers"]
    finally:
        megatron_adacc.uninstall()


@pytest.mark.parametrize("tiles", [2, 3, 32])
@pytest.mark.parametrize("rest", ["keep", "recompute"])
def test_only_the_mlp_weight_gradients_differ_and_only_by_rounding(model, batch, tiles, rest):
    """With the rest of the layer kept, and with all of it recomputed (Megatron's full recompute, the MLP tiled);
    32 tiles are one sequence position each."""
    base = decisions(recompute=OP_NAMES[1:]) if rest == "recompute" else decisions(recompute=TILED_OPS)
    loss, grads, _ = _run(model, batch, [base] * 2)
    got_loss, got, _ = _run(model, batch, [tiled(base, tiles)] * 2)
    assert abs(got_loss.item() - loss.item()) <= 1e-6 * abs(loss.item())
    differ = grads_equal(got, grads)
    assert any(name.endswith(MLP_WEIGHTS) for name in differ)  # the tiles' sums really are other sums
    for name in differ:
        scale = grads[name].abs().max()
        assert (got[name] - grads[name]).abs().max() <= 1e-5 * scale, name


def test_one_tile_is_the_untiled_re_run(model, batch):
    base = decisions(recompute=TILED_OPS)
    assert tiled(base, 1) == base  # Decision.recompute(1) is the plain recompute decision
    with pytest.raises(ValueError, match="tiles must be a whole number"):
        Decision.recompute(0)


def test_held_bytes_are_measured_as_predicted_and_the_block_holds_nothing(model, batch):
    """The MLP tiled between a recomputed attention and a recomputed residual add: the add's segment holds
    linear_fc2's output as it is (the block joins no segment), and the prediction follows."""
    chosen = tiled(decisions(recompute=OP_NAMES[1:]), 4)
    _, _, untiled = _run(model, batch, [decisions(recompute=OP_NAMES[1:])] * 2)
    _, _, rows = _run(model, batch, [chosen] * 2)
    fc2_out = 32 * 2 * 64 * 4  # tokens x hidden, fp32
    for row, full in zip(rows, untiled):
        assert row["measured_bytes"] == row["predicted_bytes"]
        assert all(row["measured"].per_op[name] == 0 for name in TILED_OPS)
        assert row["measured"].stash_bytes == full["measured"].stash_bytes + fc2_out
        assert row["measured"].rng_bytes == 2 * full["measured"].rng_bytes  # two segments with a dropout


def test_a_parameter_s_accumulation_hook_runs_once_per_backward(model, batch):
    """Megatron DDP's gradient hook sits on each parameter's accumulator and may count a parameter only once:
    the tiles' weight gradients reach autograd as one sum."""
    layer = model.decoder.layers[0]
    weight = layer.mlp.linear_fc1.weight
    accumulator = weight.expand_as(weight).grad_fn.next_functions[0][0]
    calls = []
    handle = accumulator.register_hook(lambda *_: calls.append(1))
    try:
        x = torch.randn(32, 2, 64, requires_grad=True)
        out = checkpointed_layer_forward(layer, tiled(decisions(), 4), x, batch[2])
        out.sum().backward()
    finally:
        handle.remove()
        layer.zero_grad(set_to_none=True)
    assert calls == [1]
    assert x.grad is not None


def test_tile_slices_cover_every_row_once_and_are_never_empty():
    for length, tiles in ((32, 4), (33, 4), (3, 8), (1, 1), (128, 7)):
        parts = tile_slices(length, tiles)
        assert len(parts) == min(length, tiles)
        assert [i for p in parts for i in range(length)[p]] == list(range(length))


def test_a_policy_tiles_all_three_mlp_ops_alike_or_none():
    base = decisions(recompute=TILED_OPS)
    with pytest.raises(ValueError, match="all recomputed in the same number of tiles"):
        policy_of([{**base, "activation": Decision.recompute(2)}])
    with pytest.raises(ValueError, match="all recomputed in the same number of tiles"):
        policy_of([{**tiled(base, 4), "linear_fc2": Decision.keep()}])
    with pytest.raises(ValueError, match="cannot be re-run in tiles"):
        policy_of([{**base, "pre_mlp_layernorm": Decision.recompute(4)}])
    with pytest.raises(ValueError, match="needs action recompute"):
        Decision("keep", tiles=4)


def test_policy_files_carry_tiles_and_refuse_a_wrong_one_in_one_line():
    policy = Policy.uniform({name: "recompute:tiles=8" for name in TILED_OPS}, 2)
    obj = policy_to_json(policy)
    assert obj["layers"][0]["decisions"][OP_NAMES.index("activation")]["tiles"] == 8
    assert policy_from_json(json.loads(json.dumps(obj))).same_decisions(policy)
    for bad, field in ((0, "tiles"), ("8", "tiles"), (True, "tiles")):
        wrong = json.loads(json.dumps(obj))
        wrong["layers"][1]["decisions"][OP_NAMES.index("linear_fc1")]["tiles"] = bad
        with pytest.raises(PolicySchemaError, match=rf"layers\[1\]\.decisions\[\d+\]\.{field}"):
            policy_from_json(wrong)
    wrong = json.loads(json.dumps(obj))
    wrong["layers"][0]["decisions"][OP_NAMES.index("linear_fc2")]["tiles"] = 4
    with pytest.raises(PolicySchemaError, match=r"layers\[0\]\.decisions' a tiled MLP re-run needs") as err:
        policy_from_json(wrong)
    assert "\n" not in str(err.value)
