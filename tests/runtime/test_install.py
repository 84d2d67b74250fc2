"""install() / uninstall(): idempotent, version-guarded patching of megatron's full-recompute entry point, and
configuration errors that name the flag to change."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from _runtime_helpers import decisions, grads_equal, policy_of

import megatron_adacc
from megatron_adacc.adacc.integration import UnsupportedConfigError, check_config, check_layer, entry_points
from megatron_adacc.adacc.integration import dispatch as glue
from megatron_adacc.adacc.policy.io import save_policy
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.runtime import accounting
from megatron_adacc.core.patching import is_patched
from megatron_adacc.testing import build_tiny_gpt, loss_and_grads, tiny_config


def _entry():
    """The installed release line's full-recompute entry point, as install() finds it."""
    import importlib

    from megatron_adacc.compat import megatron_line

    module, attr, _ = entry_points(megatron_line())
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def test_install_is_idempotent_and_uninstall_restores(model):
    original = _entry()
    cfg = model.config
    assert cfg.recompute_granularity is None
    megatron_adacc.install(cfg, "keep")
    patched = _entry()
    assert patched is not original and patched.__wrapped__ is original
    assert is_patched(patched)
    megatron_adacc.install(cfg, Policy.all_recompute(2))
    assert _entry() is patched  # not wrapped twice
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)
    assert glue.installed_policy().name == "recompute"
    megatron_adacc.uninstall()
    assert _entry() is original
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == (None, None, None)
    assert not hasattr(cfg, glue._CONFIG_ATTR) and not glue.is_installed()


def test_a_policy_switch_keeps_the_size_profiling_setting(model, batch):
    """Policy evolution re-installs between iterations: that must not turn the per-layer size profile (an extra
    layer forward, which shows in peak memory) back on, nor re-run it when it is on."""
    cfg = model.config
    try:
        megatron_adacc.install(cfg, "keep", predict_memory=False)
        megatron_adacc.install(cfg, Policy.all_recompute(2))
        assert glue._STATE["predict_memory"] is False
        megatron_adacc.uninstall()
        megatron_adacc.install(cfg, "keep")
        assert glue._STATE["predict_memory"] is True
        loss_and_grads(model, batch)
        profiled = set(glue._STATE["profiled"])
        assert len(profiled) == 2
        megatron_adacc.install(cfg, Policy.all_recompute(2))
        assert glue._STATE["profiled"] == profiled
    finally:
        megatron_adacc.uninstall()


def test_policy_none_leaves_megatron_untouched(model):
    original = _entry()
    assert megatron_adacc.install(model.config, "none") is None
    assert _entry() is original and model.config.recompute_granularity is None


def test_entry_points_per_release_line():
    assert entry_points((0, 16)) == ("megatron.core.transformer.transformer_block",
                                     "TransformerBlock._checkpointed_forward", ())
    module, attr, importers = entry_points((0, 19))
    assert (module, attr) == ("megatron.core.recompute", "checkpointed_forward")
    assert "megatron.core.transformer.transformer_block" in importers
    with pytest.raises(UnsupportedConfigError):
        entry_points((0, 9))


def test_019_line_patches_the_function_and_its_by_name_import(monkeypatch, model, batch):
    """On 0.17+ full recompute is megatron.core.recompute.checkpointed_forward, imported by name into
    transformer_block. Simulate that layout on the installed 0.16.1 and check both names are routed and
    restored, and that the 0.19 signature (extract_layer_indices, layer_offset) is honoured."""
    from megatron.core.transformer import transformer_block

    calls = []

    def checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                             attention_bias, packed_seq_params, use_inner_quantization_context,
                             padding_mask=None, extract_layer_indices=None, layer_offset=0):
        calls.append("megatron")
        return hidden_states

    fake = types.ModuleType("megatron.core.recompute")
    fake.checkpointed_forward = checkpointed_forward
    monkeypatch.setitem(sys.modules, "megatron.core.recompute", fake)
    monkeypatch.setattr(transformer_block, "checkpointed_forward", checkpointed_forward, raising=False)
    monkeypatch.setattr("megatron_adacc.compat.versions.megatron_line", lambda version=None: (0, 19))

    megatron_adacc.install(model.config, "keep")
    dispatcher = fake.checkpointed_forward
    assert dispatcher is not checkpointed_forward and transformer_block.checkpointed_forward is dispatcher
    block = model.decoder
    x = torch.randn(32, 2, 64, requires_grad=True)
    out, extracted = dispatcher(block, x, batch[2], None, None, None, None, None, False,
                                extract_layer_indices={1}, layer_offset=0)
    assert len(extracted) == 1 and extracted[0] is out and calls == []
    megatron_adacc.uninstall()
    assert fake.checkpointed_forward is checkpointed_forward
    assert transformer_block.checkpointed_forward is checkpointed_forward


def test_dispatcher_calls_megatron_for_configs_without_a_policy(model, batch):
    """A second model built from another config keeps Megatron's own full recompute while a policy is on."""
    other = build_tiny_gpt(seed=5, recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1)
    other.train()
    ref = loss_and_grads(other, batch)
    megatron_adacc.install(model.config, "recompute")
    accounting.clear()
    got = loss_and_grads(other, batch)
    assert accounting.latest() == {}  # the runtime never ran
    assert torch.equal(ref[0], got[0]) and grads_equal(ref[1], got[1]) == []


def test_install_before_building_the_model(batch):
    cfg_overrides = dict(seed=5)
    stock = build_tiny_gpt(**cfg_overrides)
    stock.train()
    ref = loss_and_grads(stock, batch)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_adacc.training.data import VOCAB_SIZE
    from megatron_adacc.training.distributed import set_seed

    config = tiny_config()
    megatron_adacc.install(config, policy_of([decisions(recompute=("softmax", "dropout"))] * 2))
    set_seed(5)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=VOCAB_SIZE, max_sequence_length=32)
    model.train()
    got = loss_and_grads(model, batch)
    assert torch.equal(ref[0], got[0]) and grads_equal(ref[1], got[1]) == []


def test_eval_mode_runs_plain_megatron(model, batch):
    megatron_adacc.install(model.config, "quantize-all")
    accounting.clear()
    model.eval()
    try:
        with torch.no_grad():
            tokens, pos, mask, labels = batch
            model(tokens, pos, mask, labels=labels)
    finally:
        model.train()
    assert accounting.latest() == {}


def test_preset_is_sized_at_first_forward_and_policy_files_load(model, batch, tmp_path):
    megatron_adacc.install(model.config, "quantize-all")
    assert glue.installed_policy() == "quantize-all"
    loss_and_grads(model, batch)
    assert isinstance(glue.installed_policy(), Policy) and glue.installed_policy().num_layers == 2
    megatron_adacc.uninstall()
    path = save_policy(policy_of([decisions(recompute=("context",)), decisions()], name="from-file"),
                       tmp_path / "p.json")
    megatron_adacc.install(model.config, str(path))
    assert glue.installed_policy().name == "from-file"
    loss_and_grads(model, batch)
    assert sorted(accounting.latest()) == [0, 1]


def test_policy_errors_name_the_problem(model, batch):
    megatron_adacc.install(model.config, Policy.all_keep(3))
    with pytest.raises(UnsupportedConfigError, match="has 3 layers but this model .* has 2"):
        loss_and_grads(model, batch)
    with pytest.raises(FileNotFoundError, match=r"^policy='no/such/policy.json' is neither 'auto', a preset") as e:
        megatron_adacc.install(model.config, "no/such/policy.json")
    assert "--" not in str(e.value)  # the Python API's errors speak of its arguments, not of the hosts' flags
    with pytest.raises(TypeError, match="TransformerConfig"):
        megatron_adacc.install("keep")


@pytest.mark.parametrize("field,value,flag", [
    ("fp8", "hybrid", "--fp8-format"),
    ("fp4", "nvfp4", "--fp4-format"),
    ("fine_grained_activation_offloading", True, "--fine-grained-activation-offloading"),
    ("cpu_offloading", True, "--cpu-offloading"),
    ("num_moe_experts", 8, "--num-experts"),
    ("multi_latent_attention", True, "--multi-latent-attention"),
    ("sequence_parallel", True, "--sequence-parallel"),
    ("cuda_graph_impl", "local", "--cuda-graph-impl"),
    ("recompute_granularity", "selective", "--recompute-granularity"),
])
def test_unsupported_configs_name_the_flag(field, value, flag):
    config = SimpleNamespace(**{field: value})
    with pytest.raises(UnsupportedConfigError, match=flag):
        check_config(config)


def test_install_refuses_megatron_recompute_before_patching():
    config = tiny_config(recompute_granularity="selective")
    original = _entry()
    with pytest.raises(UnsupportedConfigError, match="--recompute-granularity selective"):
        megatron_adacc.install(config, "keep")
    assert _entry() is original


def test_non_local_layers_are_refused(model):
    layer = build_tiny_gpt(seed=5).decoder.layers[0]
    check_layer(layer)
    layer.self_attention.core_attention = torch.nn.Identity()
    with pytest.raises(UnsupportedConfigError, match="DotProductAttention"):
        check_layer(layer)
    with pytest.raises(UnsupportedConfigError, match="not a megatron-core TransformerLayer"):
        check_layer(torch.nn.Linear(2, 2))
