"""GACT on megatron-core's GPT (local spec, CPU): L0 exactness, L1 through the training extension, CB1
recompute of compressed layer inputs, CB2 memory-efficient attention (both made by the extension)."""

from __future__ import annotations

import pytest
import torch

from megatron_adacc import gact
from megatron_adacc.core.extension import TrainingContext
from megatron_adacc.core.patching import is_patched, unpatch
from megatron_adacc.gact.extension import GactExtension, apply_level_effects
from megatron_adacc.gact.megatron import enable_memory_efficient_attention

pytest.importorskip("megatron.core")
from megatron_adacc.testing import build_tiny_gpt, loss_and_grads, memory_cap, tiny_batch  # noqa: E402


@pytest.fixture(autouse=True)
def _cap():
    with memory_cap(8):
        yield


def _max_rel_err(g, ref):
    return max(float((g[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)) for k in ref)


def _fwd_bwd(model, batch):
    tokens, position_ids, mask, labels = batch

    def run():
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        return loss.item()
    return run


def _with(context_fn, model, batch):
    with context_fn():
        return loss_and_grads(model, batch)


def _fixed_bits_extension(level, model, codec_factory):
    """GACT at ``level`` the way ``adacc train`` sets it up (level effects included), 4 fixed bits."""
    ext = GactExtension(level=level, bits=4, adaptive=False, group_size=64, codec_factory=codec_factory)
    ext.setup(TrainingContext(args=None, config=model.config, model=[model], ddp_model=[model], optimizer=None))
    return ext


def test_l0_extension_is_bit_identical_to_no_gact():
    model = build_tiny_gpt()
    batch = tiny_batch()
    ref_loss, ref = loss_and_grads(model, batch)
    ext = gact.build_extension(type("A", (), {"gact_level": "L0"})())
    ext.setup(TrainingContext(args=None, config=model.config, model=[model], ddp_model=[model], optimizer=None,
                              forward_backward=_fwd_bwd(model, batch)))
    ext.on_step_begin(1)
    loss, g = _with(ext.microbatch_context, model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g[k], ref[k]) for k in ref)


def test_hook_path_at_32_bits_is_bit_identical_on_gpt(codec_factory):
    """Every megatron saved tensor through the hooks (parameters skipped, de-dup, masks) but none lossy."""
    model = build_tiny_gpt()
    batch = tiny_batch()
    ref_loss, ref = loss_and_grads(model, batch)
    ctl = gact.Controller(model, level="L1", bits=32, adaptive=False, codec_factory=codec_factory)
    loss, g = _with(ctl.hooks, model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g[k], ref[k]) for k in ref)
    assert ctl.compressor.last_stats.kept_tensors > 10


def test_l1_extension_adapts_compresses_and_stays_close(codec_factory):
    model = build_tiny_gpt()
    batch, probe = tiny_batch(seed=0), tiny_batch(seed=1)
    ref_loss, ref = loss_and_grads(model, batch)
    ext = GactExtension(level="L1", bits=4, adapt_interval=5, group_size=64, codec_factory=codec_factory)
    ext.setup(TrainingContext(args=None, config=model.config, model=[model], ddp_model=[model], optimizer=None,
                              forward_backward=_fwd_bwd(model, probe)))
    ext.on_step_begin(1)
    assert all(p.grad is None for p in model.parameters())  # probe gradients discarded
    loss, g = _with(ext.microbatch_context, model, batch)
    ext.on_step_end(1, float(loss))
    rep = ext.report()
    assert rep["gact_adaptations"] == 1
    assert rep["gact_effective_bits"] <= 4 + 1e-9
    assert rep["gact_compressed_tensors"] > 10
    assert rep["saved_activation_bytes"] * 3 < rep["raw_saved_activation_bytes"]
    assert float(loss) == pytest.approx(float(ref_loss), rel=0.02)  # forward is exact; only backward is lossy
    assert _max_rel_err(g, ref) < 0.5
    # the next adaptation is due at iteration 6 (interval 5), not before
    for it in range(2, 6):
        ext.on_step_begin(it)
    assert ext.report()["gact_adaptations"] == 1
    ext.on_step_begin(6)
    assert ext.report()["gact_adaptations"] == 2


def test_probe_refuses_a_forward_backward_that_changes_batch(codec_factory):
    model = build_tiny_gpt()
    batches = iter([tiny_batch(seed=s) for s in range(200)])
    ctl = gact.Controller(model, level="L1", codec_factory=codec_factory, group_size=64)

    def fresh_batch_each_call():
        return _fwd_bwd(model, next(batches))()

    with pytest.raises(RuntimeError, match="replay the same batch"):
        ctl.adapt(fresh_batch_each_call)


def test_cb1_recomputes_from_compressed_layer_inputs(codec_factory):
    model = build_tiny_gpt()
    batch = tiny_batch()
    ref_loss, ref = loss_and_grads(model, batch)
    l1 = gact.Controller(model, level="L1", bits=4, adaptive=False, codec_factory=codec_factory, group_size=64)
    _, g1 = _with(l1.hooks, model, batch)
    cb1 = _fixed_bits_extension("CB1", model, codec_factory)
    assert model.config.recompute_granularity == "full" and model.config.recompute_num_layers == 1
    loss, g = _with(cb1.microbatch_context, model, batch)
    assert torch.equal(loss, ref_loss)  # the forward itself is untouched
    st = cb1.controller.compressor.last_stats
    assert st.recompute_bytes > 0  # activations re-saved during backward went through the hooks too
    assert cb1.report()["saved_activation_bytes"] < l1.report()["saved_activation_bytes"]
    assert _max_rel_err(g, ref) < 0.5
    model.config.recompute_granularity = "selective"
    with pytest.raises(ValueError, match="selective"):
        apply_level_effects("CB1", model)


def test_controller_at_cb1_requires_the_extension_to_have_switched_recompute_on(codec_factory):
    """The plain-PyTorch controller changes no megatron setting; on an unprepared model it names the way in."""
    model = build_tiny_gpt()
    with pytest.raises(ValueError, match="apply_level_effects"):
        gact.Controller(model, level="CB1", codec_factory=codec_factory)
    assert model.config.recompute_granularity is None  # and it left the model as it was
    assert apply_level_effects("L2", model) == []
    assert apply_level_effects("CB1", model) == ["full recompute enabled (uniform, 1 layer per checkpoint)"]
    ctl = gact.Controller(model, level="CB1", bits=4, adaptive=False, codec_factory=codec_factory)
    assert ctl.report()["gact_level"] == "CB1" and "gact_notes" not in ctl.report()


def test_cb2_attention_matches_and_saves_no_score_matrix(codec_factory):
    model = build_tiny_gpt(attention_dropout=0.0, hidden_dropout=0.0)
    batch = tiny_batch()
    ref_loss, ref = loss_and_grads(model, batch)

    def saved_bytes(m):
        n = []
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                n.append(t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(*batch[:3], labels=batch[3]).float().mean().backward()
        m.zero_grad()
        return sum(n)

    before = saved_bytes(model)
    note = enable_memory_efficient_attention([model])
    assert "2 attention modules" in note
    loss, g = loss_and_grads(model, batch)
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-5)
    assert _max_rel_err(g, ref) < 1e-4
    assert saved_bytes(model) < before
    # CB2 refuses attention dropout on CPU, naming the fix
    with pytest.raises(ValueError, match="attention-dropout 0"):
        apply_level_effects("CB2", build_tiny_gpt())


def test_cb2_attention_is_a_marked_instance_patch_that_unpatches():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    model = build_tiny_gpt(attention_dropout=0.0, hidden_dropout=0.0)
    batch = tiny_batch()
    ref_loss, ref = loss_and_grads(model, batch)
    attention = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    enable_memory_efficient_attention([model])
    assert all(is_patched(vars(m)["forward"]) for m in attention)
    assert not is_patched(DotProductAttention.forward)  # the class (other models) is untouched
    assert enable_memory_efficient_attention([model]).endswith("in 2 attention modules")  # idempotent
    assert all(m.forward.__self__ is m for m in attention)  # bound to its own module, like the original
    assert all(unpatch(m, "forward") for m in attention)
    assert all("forward" not in vars(m) for m in attention)
    loss, g = loss_and_grads(model, batch)  # the original attention again: bit-identical
    assert torch.equal(loss, ref_loss) and all(torch.equal(g[k], ref[k]) for k in ref)


def test_build_extension_reads_the_gact_flags():
    from types import SimpleNamespace

    ext = gact.build_extension(SimpleNamespace(gact_level="CB1", gact_bits=3.0, gact_adapt_interval=50,
                                               gact_group_size=128, seed=9))
    assert ext.level is gact.Level.CB1
    assert ext.kwargs["bits"] == 3.0 and ext.kwargs["adapt_interval"] == 50
    assert ext.kwargs["group_size"] == 128 and ext.kwargs["seed"] == 9 and ext.kwargs["adaptive"] is True
    fixed = gact.build_extension(SimpleNamespace(gact_level="L1", gact_adaptive=False))
    assert fixed.kwargs["adaptive"] is False


def test_adacc_train_with_gact_levels():
    """`adacc train --gact-level L1` end to end (in process): the probe replays the loop's held-out batch,
    and the run's summary carries GACT's figures."""
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    flags = ["--config", "tiny", "--num-layers", "1", "--seq-length", "32", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "2", "--no-progress"]
    base = train(parse_train_args(flags))
    s = train(parse_train_args(flags + ["--gact-level", "L1", "--gact-adapt-interval", "1000"]))
    rep = s["extensions"]["gact"]
    assert rep["gact_adaptations"] == 1 and rep["gact_effective_bits"] <= 4 + 1e-9
    assert s["saved_activation_bytes"] == rep["saved_activation_bytes"]
    assert s["saved_activation_bytes"] * 3 < base["saved_activation_bytes"]
    assert s["losses"][0] == base["losses"][0]  # the first forward is exact
    assert abs(s["final_loss"] - base["final_loss"]) < 0.05


def test_cb2_controller_combines_recompute_compression_and_sdpa(codec_factory):
    model = build_tiny_gpt(attention_dropout=0.0)
    batch = tiny_batch()
    ref_loss, ref = loss_and_grads(model, batch)
    ext = _fixed_bits_extension("CB2", model, codec_factory)
    notes = " ".join(ext.report()["gact_notes"])
    assert "full recompute enabled" in notes and "memory-efficient attention" in notes
    loss, g = _with(ext.microbatch_context, model, batch)
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-5)
    assert _max_rel_err(g, ref) < 0.5
