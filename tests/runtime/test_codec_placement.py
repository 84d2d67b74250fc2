"""Codecs on the right tensors (issue 20, item 2): the channel-wise Q/K/V codec's channels are the head dimension,
whatever layout the attention saves them in, and no tensor under the size threshold (norm statistics, RoPE tables,
the SDPA log-sum-exp, scalars) is compressed. On the tiny GeLU model with each attention, and a Llama-style one
(RMSNorm, SwiGLU, RoPE, two key/value heads for four query heads) with SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _runtime_helpers import decisions

import megatron_adacc
from megatron_adacc.adacc.policy.ops import OPS, OPS_BY_NAME
from megatron_adacc.adacc.policy.policy import Decision, Policy
from megatron_adacc.adacc.runtime.checkpoint import checkpointed_layer_forward, small_tensor_numel
from megatron_adacc.codecs.base import Codec
from megatron_adacc.codecs.registry import CODECS
from megatron_adacc.testing import build_tiny_gpt

S, B, H, HEADS = 32, 2, 64, 4
HEAD_DIM = H // HEADS
LLAMA = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
             num_query_groups=2, position_embedding_type="rope")
MODELS = {"gelu-unfused": ("local", {}), "gelu-sdpa": ("flash", {}), "llama-sdpa": ("flash", LLAMA),
          "llama-unfused": ("local", LLAMA)}


@pytest.fixture(scope="module", params=list(MODELS))
def layer(request):
    backend, overrides = MODELS[request.param]
    model = build_tiny_gpt(seed=5, attention_backend=backend, **{"attention_dropout": 0.0, **overrides})
    model.train()
    return model.decoder.layers[0]


class _Recorder:
    """Every tensor a codec of the registry compresses: ``(codec, shape, stride)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.seen: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for cls in CODECS.values():
            if "compress" in vars(cls):
                monkeypatch.setattr(cls, "compress", self._wrap(cls.compress))

    def _wrap(self, original):
        def compress(codec: Codec, x: torch.Tensor, *args, **kwargs):
            self.seen.append((codec.name, tuple(x.shape), x.stride()))
            return original(codec, x, *args, **kwargs)
        return compress


def _run(layer, chosen, monkeypatch) -> tuple[_Recorder, torch.Tensor]:
    recorder = _Recorder(monkeypatch)
    x = torch.randn(S, B, H, requires_grad=True)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    out = checkpointed_layer_forward(layer, chosen, x, mask)
    out.sum().backward()
    return recorder, x


@pytest.mark.parametrize("codec", ["int4_smoothed", "int4_channelwise"])
def test_the_qkv_codec_sees_the_head_dimension_as_its_channels(layer, monkeypatch, codec):
    """Every tensor linear_qkv's channel-wise codecs receive has the head dimension last and contiguous in memory:
    K of the unfused scores too, which Megatron saves transposed ([b x heads, head dim, s])."""
    assert OPS_BY_NAME["linear_qkv"].codecs[:2] == ("int4_smoothed", "int4_channelwise")
    recorder, _ = _run(layer, decisions(compress={"linear_qkv": codec}), monkeypatch)
    seen = [(shape, stride) for name, shape, stride in recorder.seen if name == codec]
    assert len(seen) >= 3  # q, k and v (or the mixed QKV's views of them)
    for shape, stride in seen:
        assert shape[-1] == HEAD_DIM and stride[-1] == 1, (shape, stride)


def test_no_tensor_under_the_threshold_is_compressed(layer, monkeypatch):
    """With every op compressed (the layer-specific codecs, and plain INT4), the codecs see only tensors of at
    least the threshold, which lies above every statistic and table and below a key/value head."""
    limit = small_tensor_numel(layer, torch.empty(S, B, H))
    tokens = S * B
    assert max(tokens, tokens * HEADS, S * HEAD_DIM) < limit <= tokens * HEAD_DIM  # stats, lse, RoPE < K/V head
    for codec in (None, "int4_symmetric"):
        chosen = {op.name: Decision.compress(codec or op.default_codec)
                  for op in OPS}
        recorder, _ = _run(layer, chosen, monkeypatch)
        sizes = [int(torch.Size(shape).numel()) for _, shape, _ in recorder.seen]
        assert sizes and min(sizes) >= limit, sorted(sizes)[:4]


def test_small_tensors_are_kept_in_the_measured_and_predicted_bytes(layer):
    """The prediction routes small tensors as the runtime does: layer-specific compression of every op measures
    what the per-op sizes predict (norm statistics and tables filed as kept bytes of their op)."""
    from megatron_adacc.adacc.runtime import accounting, predict_layer_memory, profile_layer_sizes
    from megatron_adacc.adacc.runtime.memory import _codecs_of

    chosen = Policy.uniform("compress", 1).layer_decisions(0)
    x = torch.randn(S, B, H, requires_grad=True)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    sizes = profile_layer_sizes(layer, x, mask, codecs=_codecs_of(chosen))
    accounting.clear()
    checkpointed_layer_forward(layer, chosen, x, mask, layer_index=0)
    measured = accounting.latest()[0]
    assert measured.total_bytes == predict_layer_memory(chosen, sizes).total_bytes


# ------------------------------------------------------------------ grouped-query attention, unfused: K/V once
@pytest.fixture(scope="module")
def llama_unfused():
    """The Llama-style model with megatron's unfused attention, which repeats K and V for its matmuls; hidden
    dropout on."""
    backend, overrides = MODELS["llama-unfused"]
    model = build_tiny_gpt(seed=5, attention_backend=backend, **{"attention_dropout": 0.0, **overrides})
    model.train()
    return model


def test_repeated_keys_and_values_are_their_source(llama_unfused):
    """The matmuls save views of the repeated K and V; the runtime files them under linear_qkv as K and V
    themselves (each once), not as scores' and context's own tensors."""
    from megatron_adacc.adacc.runtime import profile_layer_sizes
    from megatron_adacc.adacc.runtime.memory import _codecs_of

    layer = llama_unfused.decoder.layers[0]
    x = torch.randn(S, B, H, requires_grad=True)
    chosen = decisions(compress={"linear_qkv": "int4_channelwise"})
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    sizes = profile_layer_sizes(layer, x, mask, llama_unfused.rotary_pos_emb(S), codecs=_codecs_of(chosen))
    # each held a repeated copy: now scores holds nothing, context only its output (saved by linear_proj)
    assert (sizes.ops["scores"].saved_bytes, sizes.ops["context"].saved_bytes) == (0, S * B * H * 4)
    kv_head = S * B * HEAD_DIM * 4
    # RoPE'd Q (4 heads) and K (2 heads), V, a view of the mixed QKV (4 + 2 + 2 heads), and RoPE's cos and sin
    # tables for each (4 x S x head dim, two heads' worth at B = 2): no repeat of K or V
    assert sizes.ops["linear_qkv"].saved_bytes == (4 + 2 + 8 + 2) * kv_head


@pytest.mark.parametrize("policy", ["keep", "linear_qkv", "attention"])
def test_unfused_grouped_query_attention_stays_exact(llama_unfused, policy):
    """Bit for bit against stock megatron: every op kept (through the decomposition, which stores K and V once),
    linear_qkv recomputed (the repeats re-made from the recomputed K and V), and the attention recomputed."""
    from _runtime_helpers import grads_equal, policy_of

    from megatron_adacc.testing import loss_and_grads, tiny_batch

    batch = tiny_batch()
    megatron_adacc.uninstall()
    ref = loss_and_grads(llama_unfused, batch)
    recompute = {"keep": (), "linear_qkv": ("linear_qkv",),
                 "attention": ("linear_qkv", "scores", "softmax", "dropout", "context")}[policy]
    megatron_adacc.install(llama_unfused.config, policy_of([decisions(recompute=recompute)] * 2))
    try:
        loss, grads = loss_and_grads(llama_unfused, batch)
        report = megatron_adacc.adacc.runtime.memory_report()
    finally:
        megatron_adacc.uninstall()
    assert torch.equal(loss, ref[0])
    assert grads_equal(grads, ref[1]) == []
    assert all(row["measured_bytes"] == row["predicted_bytes"] for row in report["layers"])
