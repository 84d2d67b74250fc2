"""The SDPA core attention (``--attention-backend flash``): right without Adacc, and exact or bounded under it.

Two models, both with hidden dropout on: the tiny GeLU/LayerNorm GPT and a Llama-style one (RMSNorm, SwiGLU,
rotary positions, two key/value heads for four query heads, no biases). Attention dropout is 0: PyTorch's CPU
kernel has none (refused, below); the RNG replay of a ``context`` op that draws is tested on SDPA's reference
math, which does take dropout.
"""

import pytest
import torch
import torch.nn.functional as F
from _runtime_helpers import decisions, grads_equal, megatron_full_recompute, policy_of

import megatron_adacc
from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.runtime import accounting, memory_report, predict_layer_memory, profile_layer_sizes
from megatron_adacc.adacc.runtime.checkpoint import checkpointed_layer_forward
from megatron_adacc.adacc.runtime.memory import _codecs_of
from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.core.saved import SavedTensorMeter
from megatron_adacc.testing import build_tiny_gpt, grad_rel_error, loss_and_grads, tiny_batch

S, B, H, HEADS, FFN = 32, 2, 64, 4, 256
F32 = 4
LLAMA = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
             num_query_groups=2, position_embedding_type="rope")
VARIANTS = {"gelu": {}, "llama": LLAMA}
ATTENTION_OPS = ("scores", "softmax", "dropout")  # empty under SDPA: the kernel is the context op


def _build(variant: str, attention_backend: str = "flash", **overrides) -> torch.nn.Module:
    model = build_tiny_gpt(seed=5, attention_backend=attention_backend,
                           **{"attention_dropout": 0.0, **VARIANTS[variant], **overrides})
    model.train()
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def sdpa(request):
    """(variant, its model with SDPA attention)."""
    megatron_adacc.uninstall()
    model = _build(request.param)
    return request.param, model


@pytest.fixture(scope="module")
def stock(sdpa, batch):
    megatron_adacc.uninstall()
    return loss_and_grads(sdpa[1], batch)


def _with_policy(model, batch, policy, **kwargs):
    megatron_adacc.install(model.config, policy, **kwargs)
    try:
        return loss_and_grads(model, batch)
    finally:
        megatron_adacc.uninstall()


# ------------------------------------------------------------------------------------------------ the module
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sdpa_computes_what_megatrons_unfused_attention_computes(variant, batch):
    unfused, fused = _build(variant, "local"), _build(variant, "flash")
    assert [type(m.decoder.layers[0].self_attention.core_attention).__name__ for m in (unfused, fused)] == \
        ["DotProductAttention", "SDPAttention"]
    ref_loss, ref = loss_and_grads(unfused, batch)
    loss, grads = loss_and_grads(fused, batch)
    # the same weights, hidden-dropout masks and math; other kernels round otherwise: close, not equal
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert grad_rel_error(grads, ref) < 1e-5


def test_grouped_query_attention_reaches_the_kernel_unrepeated():
    """GQA equals attention over explicitly repeated K/V, and the kernel saves K and V at their own size."""
    core = _build("llama").decoder.layers[0].self_attention.core_attention
    assert core.grouped
    torch.manual_seed(0)
    q = torch.randn(S, B, HEADS, H // HEADS, requires_grad=True)
    k, v = (torch.randn(S, B, 2, H // HEADS, requires_grad=True) for _ in range(2))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        grouped = core(q, k, v, None)
    core.grouped = False
    try:
        repeated = core(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), None)
    finally:
        core.grouped = True
    assert torch.allclose(grouped, repeated, rtol=0, atol=1e-6)
    assert grouped.shape == (S, B, H)
    kv_storages = {t.untyped_storage().data_ptr() for t in saved} & {t.untyped_storage().data_ptr() for t in (k, v)}
    assert len(kv_storages) == 2  # K and V themselves, not repeated copies


def test_attention_dropout_on_the_cpu_is_refused_with_the_flag():
    model = build_tiny_gpt(seed=5, attention_backend="flash")  # attention dropout 0.1
    model.train()
    tokens, positions, mask, labels = tiny_batch()
    with pytest.raises(IntegrationError, match="use --attention-dropout 0"):
        model(tokens, positions, mask, labels=labels)
    model.eval()  # no dropout outside training: runs
    assert model(tokens, positions, mask, labels=labels).shape == labels.shape


# ------------------------------------------------------------------------------------------------ exactness
def test_keep_through_the_ops_equals_stock(sdpa, batch, stock):
    """A policy that keeps every tensor but runs the op decomposition (an empty op 'compressed': nothing to
    compress) gives stock's loss and gradients bit for bit; so does the all-keep preset (megatron's forward)."""
    _, model = sdpa
    for policy in (policy_of([decisions(compress={"scores": "int4_asymmetric"})] * 2), Policy.all_keep(2)):
        loss, grads = _with_policy(model, batch, policy)
        assert torch.equal(loss, stock[0])
        assert grads_equal(grads, stock[1]) == []


def test_recompute_preset_equals_megatron_full_recompute(sdpa, batch):
    _, model = sdpa
    full = megatron_full_recompute(model, batch)
    loss, grads = _with_policy(model, batch, "recompute")
    assert torch.equal(loss, full[0])
    assert grads_equal(grads, full[1]) == []


@pytest.mark.parametrize("op", OP_NAMES[1:])
def test_single_op_recompute_is_bit_identical(sdpa, batch, stock, op):
    _, model = sdpa
    loss, grads = _with_policy(model, batch, policy_of([decisions(recompute=(op,))] * 2))
    assert torch.equal(loss, stock[0])
    assert grads_equal(grads, stock[1]) == []


def test_segments_across_the_attention_are_bit_identical(sdpa, batch, stock):
    _, model = sdpa
    policy = policy_of([decisions(recompute=("linear_qkv", "scores", "softmax", "dropout", "context")),
                        decisions(recompute=("linear_qkv", "context", "linear_proj", "self_attn_bda"))])
    loss, grads = _with_policy(model, batch, policy)
    assert torch.equal(loss, stock[0])
    assert grads_equal(grads, stock[1]) == []


def test_compress_within_the_bounds_of_the_unfused_attention(sdpa, batch, stock):
    """test_compress.py's bound, for the layer-specific codecs and plain INT4 everywhere."""
    _, model = sdpa
    for policy in (Policy.uniform("compress", 2, name="layer-specific"), Policy.quantize_all(2)):
        loss, grads = _with_policy(model, batch, policy, predict_memory=False)
        assert torch.equal(loss, stock[0])  # compression changes what backward reads, never the forward
        assert 0 < grad_rel_error(grads, stock[1]) < 0.12


# ------------------------------------------------------------------------------- a context op that draws
@pytest.fixture
def cpu_dropout_allowed(monkeypatch):
    """Attention dropout through SDPA's reference math on the CPU (what the refusal prevents in training: it
    stores the s x s tensors), for the runtime's RNG replay of a ``context`` op that draws random numbers."""
    from megatron_adacc.models import attention

    monkeypatch.setattr(attention, "dropout_problem", lambda *_: None)
    model = _build("llama", attention_dropout=0.1)
    return model


def test_recomputed_context_replays_attention_dropout(cpu_dropout_allowed, batch):
    model = cpu_dropout_allowed
    ref = loss_and_grads(model, batch)
    for recompute in (("context",), ("linear_qkv", "scores", "softmax", "dropout", "context", "linear_proj")):
        loss, grads = _with_policy(model, batch, policy_of([decisions(recompute=recompute)] * 2))
        assert torch.equal(loss, ref[0])
        assert grads_equal(grads, ref[1]) == [], recompute


def test_the_context_op_really_draws(cpu_dropout_allowed, batch):
    """Guards the test above: re-run without the saved RNG states, the recomputed context differs."""
    from megatron_adacc.adacc.runtime import checkpoint

    model = cpu_dropout_allowed
    ref = loss_and_grads(model, batch)
    original = checkpoint._replay_rng
    checkpoint._replay_rng = lambda states: original(None)
    try:
        _, grads = _with_policy(model, batch, policy_of([decisions(recompute=("context",))] * 2))
    finally:
        checkpoint._replay_rng = original
    assert grads_equal(grads, ref[1]) != []


# ------------------------------------------------------------------------------------------------ memory
def _hand_count_all_keep() -> int:
    """What one tiny GeLU layer with SDPA attention saves with every op kept (fp32, LayerNorm, biases, hidden
    dropout on): unfused's count (test_memory.py) without its three s x s tensors, plus the log-sum-exp."""
    act = S * B * H * F32
    ln_stats = 2 * S * B * F32
    return (act                                     # layer input (saved by input_layernorm)
            + act + ln_stats                        # ln1 (saved by linear_qkv) + stats
            + 3 * act                               # mixed QKV (q, k, v views saved by the kernel)
            + act                                   # kernel output = context (one storage: saved by the kernel
            #                                         and by linear_proj)
            + B * HEADS * S * F32                   # log-sum-exp (saved by the kernel)
            + act + act                             # hidden-dropout multiplier + attn_out (by pre-MLP norm)
            + act + ln_stats                        # ln2 (saved by linear_fc1) + stats
            + 2 * S * B * FFN * F32                 # fc1+bias (saved by GeLU) and GeLU output (by linear_fc2)
            + act)                                  # MLP dropout multiplier


def test_all_keep_matches_hand_count_and_independent_meter(batch):
    layer = _build("gelu").decoder.layers[0]
    x = torch.randn(S, B, H, requires_grad=True)
    with SavedTensorMeter(list(layer.parameters())) as meter:
        out = layer(hidden_states=x, attention_mask=batch[2])[0]
    del out
    accounting.clear()
    checkpointed_layer_forward(layer, decisions(), x, batch[2], layer_index=0)
    measured = accounting.latest()[0]
    assert measured.total_bytes == meter.nbytes == _hand_count_all_keep() == 296960  # the kernel reads no mask
    assert all(measured.per_op[op] == 0 for op in ATTENTION_OPS)


def _memory_policies() -> dict[str, Policy]:
    return {
        "keep": Policy.all_keep(2),
        "recompute": Policy.all_recompute(2),
        "quantize-all": Policy.quantize_all(2),
        "layer-specific": Policy.uniform("compress", 2),
        "recompute-context": policy_of([decisions(recompute=("context",))] * 2),
        "stash-mix": policy_of([
            decisions(compress={"linear_qkv": "int4_channelwise"}, recompute=("context", "activation")),
            decisions(recompute=("linear_qkv", "scores", "context", "linear_fc1", "activation"),
                      compress={"self_attn_bda": "int4_outlier"}),
        ]),
    }


MEMORY_POLICIES = _memory_policies()


@pytest.mark.parametrize("name", list(MEMORY_POLICIES))
def test_measured_equals_predicted(sdpa, batch, name):
    _, model = sdpa
    megatron_adacc.install(model.config, MEMORY_POLICIES[name])
    loss_and_grads(model, batch)
    report = memory_report()
    assert len(report["layers"]) == 2
    for row in report["layers"]:
        assert row["measured_bytes"] == row["predicted_bytes"], (row["measured"], row["predicted"])
        assert all(row["measured"].per_op[op] == 0 for op in ATTENTION_OPS)


def test_sizes_are_those_of_the_kernel(sdpa, batch):
    """The kernel's tensors belong where the runtime files them: q, k, v to linear_qkv, its output and
    log-sum-exp to context; the three attention ops hold nothing; a segment with context carries RNG states."""
    variant, model = sdpa
    layer = model.decoder.layers[0]
    x = torch.randn(S, B, H, requires_grad=True)
    chosen = decisions(recompute=("context",))
    sizes = profile_layer_sizes(layer, x, batch[2], codecs=_codecs_of(chosen))
    assert sizes.kind == "sdpa"
    assert all(sizes.ops[op].saved_bytes == sizes.ops[op].saved_count == 0 for op in ATTENTION_OPS)
    # output (= context, one storage) and log-sum-exp: the unfused context's bytes and no s x s tensor
    assert sizes.ops["context"].saved_bytes == S * B * H * F32 + B * HEADS * S * F32
    assert predict_layer_memory(chosen, sizes).rng_bytes == sizes.rng_bytes > 0
    # the unfused table would file the kernel's saves under other ops, and draw in 'dropout'
    assert predict_layer_memory(decisions(recompute=("dropout",)), sizes).rng_bytes == 0
    if variant == "gelu":
        assert sizes.ops["linear_qkv"].saved_bytes == 3 * S * B * H * F32  # the mixed QKV, viewed by q, k, v


def test_the_python_api_profiles_the_models_attention(sdpa, monkeypatch, tmp_path):
    """``install(model, "auto")`` profiles a one-layer model with the core attention of ``model``."""
    from megatron_adacc.adacc.integration import sample

    built = []
    original = sample.one_layer_gpt
    monkeypatch.setattr(sample, "one_layer_gpt", lambda *a: built.append(original(*a)) or built[-1])
    _, model = sdpa
    policy = megatron_adacc.install(model, "auto", budget="4GiB", micro_batch_size=2, codec="none",
                                    profile_db=tmp_path / "profiles.sqlite")
    assert policy.num_layers == 2
    assert [type(m.decoder.layers[0].self_attention.core_attention).__name__ for m in built] == ["SDPAttention"]
