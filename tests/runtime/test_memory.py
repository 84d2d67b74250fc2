"""Bytes held for backward: the runtime's measurement, an independent meter, a hand count, and the prediction
from per-op sizes agree."""

import random

import pytest
import torch
from _runtime_helpers import decisions, policy_of

import megatron_adacc
from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.runtime import memory_report, predict_layer_memory, profile_layer_sizes
from megatron_adacc.adacc.runtime.checkpoint import checkpointed_layer_forward
from megatron_adacc.adacc.runtime.memory import _codecs_of
from megatron_adacc.core.saved import SavedTensorMeter
from megatron_adacc.testing import loss_and_grads, tiny_batch

S, B, H, HEADS, FFN = 32, 2, 64, 4, 256
F32 = 4


def _hand_count_all_keep() -> int:
    """What one tiny layer saves with every op kept (fp32, LayerNorm, GeLU, biases, dropout on, CPU dropout
    masks are fp32 multipliers)."""
    act = S * B * H * F32
    ln_stats = 2 * S * B * F32                      # LayerNorm mean and rstd
    probs = B * HEADS * S * S * F32
    return (act                                     # layer input (saved by input_layernorm)
            + act + ln_stats                        # ln1 (saved by linear_qkv) + stats
            + 3 * act                               # mixed QKV (views saved by the two attention matmuls)
            + probs                                 # softmax output (saved by softmax)
            + 2 * probs                             # attention-dropout multiplier + dropped probs (by bmm)
            + act                                   # context (saved by linear_proj)
            + act + act                             # hidden-dropout multiplier + attn_out (by pre-MLP norm)
            + act + ln_stats                        # ln2 (saved by linear_fc1) + stats
            + 2 * S * B * FFN * F32                 # fc1+bias (saved by GeLU) and GeLU output (by linear_fc2)
            + act)                                  # MLP dropout multiplier


def test_all_keep_matches_hand_count_and_independent_meter(model, batch):
    layer = model.decoder.layers[0]
    x = torch.randn(S, B, H, requires_grad=True)
    params = list(layer.parameters())
    with SavedTensorMeter(params) as meter:
        out = layer(hidden_states=x, attention_mask=batch[2])[0]
    del out
    megatron_adacc.adacc.runtime.accounting.clear()
    checkpointed_layer_forward(layer, decisions(), x, batch[2], layer_index=0)
    measured = megatron_adacc.adacc.runtime.accounting.latest()[0].total_bytes
    # The meter also counts the attention mask, which every layer shares; the runtime leaves it out of the
    # per-layer figure.
    shared_mask = batch[2].untyped_storage().nbytes()
    assert measured == meter.nbytes - shared_mask == _hand_count_all_keep() == 394240


def test_a_keep_all_layer_runs_megatrons_forward_and_is_still_counted(model, batch, monkeypatch):
    """The dispatcher sends a layer whose policy keeps everything to megatron's own forward (no op
    decomposition); its bytes are still filed, equal to the runtime's own count."""
    import megatron_adacc.adacc.runtime.checkpoint as ck
    from megatron_adacc.adacc.runtime.checkpoint import stock_layer_forward

    layer = model.decoder.layers[0]
    x = torch.randn(S, B, H, requires_grad=True)
    megatron_adacc.adacc.runtime.accounting.clear()
    stock_layer_forward(layer, x, batch[2], layer_index=0)
    stock = megatron_adacc.adacc.runtime.accounting.latest()[0]
    assert stock.stock_bytes > 0 and stock.total_bytes == _hand_count_all_keep()

    calls = []
    monkeypatch.setattr(ck, "checkpointed_layer_forward",
                        lambda *a, **k: calls.append(1) or pytest.fail("keep-all layer took the runtime path"))
    megatron_adacc.install(model.config, policy_of([decisions(), decisions(recompute=["activation"])]))
    megatron_adacc.adacc.runtime.accounting.clear()
    with pytest.raises(BaseException, match="runtime path"):
        loss_and_grads(model, batch)  # layer 0 keeps everything: megatron's forward; layer 1 needs the runtime
    assert megatron_adacc.adacc.runtime.accounting.latest()[0].stock_bytes == stock.stock_bytes


def _policies() -> dict[str, Policy]:
    rng = random.Random(3)
    codecs = {"linear_qkv": "int4_channelwise", "scores": "int4_asymmetric", "softmax": "int4_asymmetric",
              "dropout": "int4_asymmetric", "activation": "int4_outlier", "linear_fc1": "int4_outlier",
              "context": "int4_outlier", "self_attn_bda": "int4_outlier", "input_layernorm": "int4_outlier"}

    def random_layer():
        rec = [n for n in OP_NAMES[1:] if rng.random() < 0.35]
        comp = {n: c for n, c in codecs.items() if n not in rec and rng.random() < 0.5}
        return decisions(recompute=rec, compress=comp)

    return {
        "keep": Policy.all_keep(2),
        "recompute": Policy.all_recompute(2),
        "quantize-all": Policy.quantize_all(2),
        "layer-specific": Policy.uniform("compress", 2),
        # compressed producers feeding recompute segments (stored inputs are packed), a segment reading an
        # earlier segment's output (stored input is a token), and a segment whose input nobody else saves
        "stash-mix": policy_of([
            decisions(compress={"scores": "int4_asymmetric", "linear_fc1": "int4_outlier"},
                      recompute=("softmax", "activation")),
            decisions(recompute=("linear_qkv", "context", "linear_fc1", "activation")),
        ]),
        "random-a": policy_of([random_layer(), random_layer()]),
        "random-b": policy_of([random_layer(), random_layer()]),
    }


POLICIES = _policies()


@pytest.mark.parametrize("name", list(POLICIES))
def test_measured_equals_predicted_on_the_profiled_batch(model, batch, name):
    megatron_adacc.install(model.config, POLICIES[name])
    loss_and_grads(model, batch)
    report = memory_report()
    assert len(report["layers"]) == 2
    for row in report["layers"]:
        # Same batch as the profile: the prediction follows the runtime's rules exactly.
        assert row["measured_bytes"] == row["predicted_bytes"], (row["measured"], row["predicted"])
    assert report["measured_bytes"] == report["predicted_bytes"]


@pytest.mark.parametrize("name", ["layer-specific", "stash-mix", "random-a"])
def test_measured_within_five_percent_of_predicted_on_another_batch(model, batch, name):
    megatron_adacc.install(model.config, POLICIES[name])
    loss_and_grads(model, batch)                            # the first forward profiles the sizes
    loss_and_grads(model, tiny_batch(seed=17), rng_seed=3)  # other tokens, other dropout masks
    for row in memory_report()["layers"]:
        assert row["rel_error"] <= 0.05, row


def test_policies_order_memory_as_expected(model, batch):
    totals = {}
    for name in ("keep", "quantize-all", "recompute"):
        megatron_adacc.install(model.config, POLICIES[name])
        loss_and_grads(model, batch)
        totals[name] = memory_report()["measured_bytes"]
    assert totals["recompute"] < totals["quantize-all"] < totals["keep"] / 4


def test_profile_sizes_and_prediction_api(model, batch):
    layer = model.decoder.layers[1]
    x = torch.randn(S, B, H, requires_grad=True)
    policy = POLICIES["stash-mix"]
    sizes = profile_layer_sizes(layer, x, batch[2], codecs=_codecs_of(policy.layer_decisions(0)))
    assert sizes.ops["softmax"].saved_bytes == B * HEADS * S * S * F32
    assert sizes.ops["scores"].saved_bytes == 0  # nothing saves the raw scores ...
    assert sizes.ops["scores"].stash_keep_bytes["scores"] == B * HEADS * S * S * F32  # ... unless stored
    predicted = predict_layer_memory(policy.layer_decisions(0), sizes)
    assert predicted.stash_bytes > 0 and predicted.rng_bytes == 0
    assert sizes.to_json()["ops"]["linear_qkv"]["saved_bytes"] == 3 * S * B * H * F32


def test_profiling_a_layer_leaves_nothing_of_its_forward_alive(model, batch):
    """The profiled forward's graph held its pack hook and the hook held the saved tensors: a cycle through
    autograd's C++ nodes that no collector frees, so every layer's profiled activations stayed for the whole run."""
    import gc

    def graph_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)

    layer = model.decoder.layers[0]
    x = torch.randn(S, B, H, requires_grad=True)
    before = graph_tensors()
    profile_layer_sizes(layer, x, batch[2], codecs=_codecs_of(POLICIES["stash-mix"].layer_decisions(0)))
    assert graph_tensors() == before
