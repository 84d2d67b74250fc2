"""``pretrain_gpt.py --adama``: buffer-less DDP stand-ins and AdamA in place of Megatron's optimizer.

Uses the real AdamA (megatron_adacc.optim) and the installed megatron-core's DDP class, with the fake
Megatron-LM training module (Megatron-LM itself is absent here by design).
"""

from __future__ import annotations

import types

import pytest
import torch
from megatron_lm_fakes import TinyModel, forward_step, make_fake_dist_utils, make_fake_training, megatron_args

from megatron_adacc import megatron_lm
from megatron_adacc.megatron_lm import IntegrationError

pytest.importorskip("megatron.core")
from megatron.core.distributed import DistributedDataParallel  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from megatron_adacc.optim.chunks import AdamAChunk, MegatronLMAdamA, wrap_model_chunks  # noqa: E402


def adama_args(**overrides):
    defaults = dict(clip_grad=0.0, lr=0.1, min_lr=0.1, weight_decay=0.0, micro_batch_size=1,
                    global_batch_size=2, bf16=False, fp16=False)
    defaults.update(overrides)
    return megatron_args("--adama", **defaults)


def test_the_stand_in_is_a_ddp_without_a_gradient_buffer():
    model = TinyModel()
    (chunk,) = wrap_model_chunks([model], ddp_config="cfg")
    assert isinstance(chunk, DistributedDataParallel)  # unwrap_model and checkpointing see through it
    assert unwrap_model([chunk]) == [model]
    assert chunk.ddp_config == "cfg" and chunk.config is model.config
    assert [n for n, _ in chunk.named_parameters()] == ["module.weight"]
    assert not hasattr(model.weight, "main_grad")  # DDP's buffer view never created
    chunk.zero_grad_buffer()
    chunk.finish_grad_sync()
    with chunk.no_sync():
        pass
    assert chunk.state_dict().keys() == model.state_dict().keys()
    with pytest.raises(RuntimeError, match="--calculate-per-token-loss"):
        chunk.scale_gradients(0.5)


def test_adama_replaces_ddp_and_optimizer_and_trains():
    dist_utils = make_fake_dist_utils()
    training = make_fake_training(num_microbatches=2, dist_utils=dist_utils)
    args = adama_args()
    session = megatron_lm.configure(args, training=training, dist_utils=dist_utils)
    assert session.names == ["adama"]

    model, optimizer, _ = training.setup_model_and_optimizer("encoder_or_decoder")
    assert isinstance(model[0], AdamAChunk)
    assert isinstance(optimizer, MegatronLMAdamA) and optimizer.is_stub_optimizer is False
    assert training.optimizer_builds == []  # Megatron's own optimizer was never built

    weight = model[0].module.weight
    before = weight.detach().clone()
    training.train_step(forward_step, None, model, optimizer, None, None, None, iteration=0)
    assert weight.grad is None  # folded into m and v during backward, then freed
    # AdamA's first step (Algorithm 2): m_hat = sum of micro-batch gradients, v_hat = sum of their squares.
    # Both micro-batches give the same gradient g, so the step is lr * 2g / sqrt(2 g^2) = lr * sqrt(2) on
    # every coordinate with g != 0 (x[0] = 0 gives weight[0] no gradient).
    moved = (weight.detach() - before).abs()
    assert torch.allclose(moved[1:], torch.full((3,), 0.1 * 2**0.5), rtol=1e-4) and moved[0] == 0


def test_without_adama_the_builder_and_optimizer_are_megatrons():
    dist_utils = make_fake_dist_utils()
    original_wrap = dist_utils._ddp_wrap
    training = make_fake_training(dist_utils=dist_utils)
    megatron_lm.configure(megatron_args("--adacc-policy", "none"), training=training, dist_utils=dist_utils)
    assert dist_utils._ddp_wrap is original_wrap
    model, optimizer, _ = training.setup_model_and_optimizer("encoder_or_decoder")
    assert not isinstance(model[0], AdamAChunk) and optimizer == "megatron-optimizer"


@pytest.mark.parametrize("overrides, message", [
    ({"clip_grad": 1.0}, "--clip-grad 0"),
    ({"fp16": True}, "Use --bf16"),
    ({"calculate_per_token_loss": True}, "--calculate-per-token-loss"),
    ({"save": "/ckpt", "ckpt_format": "torch_dist"}, "--ckpt-format torch"),
])
def test_adama_refusals_name_the_flag(overrides, message):
    training, dist_utils = make_fake_training(), make_fake_dist_utils()
    with pytest.raises(IntegrationError, match=message.replace("-", r"\-")):
        megatron_lm.configure(adama_args(**overrides), training=training, dist_utils=dist_utils)


def test_build_optimizer_refuses_chunks_it_did_not_wrap():
    from megatron_adacc.optim.chunks import build_optimizer

    with pytest.raises(TypeError, match="AdamAChunk"):
        build_optimizer(types.SimpleNamespace(), [torch.nn.Linear(2, 2)])
