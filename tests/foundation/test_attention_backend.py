"""`adacc train --attention-backend`, `--group-query-attention --num-query-groups` and configs/llama-tiny.toml:
the model they build, what `--adacc-policy auto` profiles for it, and the command lines they refuse."""

import pytest
import torch

from megatron_adacc.core.errors import AdaccError
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

#: llama-tiny's shape, shrunk so a run with profiling takes seconds.
SMALL = ["--config", "llama-tiny", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--no-progress"]


@pytest.fixture(autouse=True)
def _own_profiles(monkeypatch, tmp_path):
    """A profile database of this test's own: a profile of the unfused attention must not serve SDPA (the model
    signature does not tell the two apart yet)."""
    monkeypatch.setenv("ADACC_PROFILE_DB", str(tmp_path / "profile.sqlite"))
    yield
    from megatron_adacc.adacc.integration import uninstall

    uninstall()


def _core_attention(model: torch.nn.Module) -> str:
    return type(model.decoder.layers[0].self_attention.core_attention).__name__


@pytest.mark.long
def test_llama_tiny_trains_with_sdpa_under_the_solved_policy():
    summary, model = train(parse_train_args(SMALL + ["--attention-backend", "flash", "--adacc-policy", "auto",
                                                     "--train-iters", "2"]), return_model=True)
    assert summary["iterations"] == 2 and "adacc" in summary["extensions"]
    assert _core_attention(model) == "SDPAttention"
    config = model.config
    assert (config.num_query_groups, config.normalization, config.gated_linear_unit, config.add_bias_linear) == \
        (2, "RMSNorm", True, False)
    assert model.position_embedding_type == "rope"


@pytest.mark.parametrize("backend, expected", [("flash", "SDPAttention"), ("fused", "SDPAttention"),
                                               ("auto", "DotProductAttention"), ("local", "DotProductAttention"),
                                               ("unfused", "DotProductAttention")])
def test_auto_profiles_the_attention_the_run_builds(backend, expected):
    """The one-layer model `--adacc-policy auto` profiles has the core attention of the trained one."""
    from megatron_adacc.adacc.integration.sample import layer_sample
    from megatron_adacc.training import model as model_lib

    args = parse_train_args(SMALL + ["--attention-backend", backend])
    config = model_lib.transformer_config(args, torch.device("cpu"))
    sample = layer_sample(args, config, torch.device("cpu"))
    assert type(sample.layer.self_attention.core_attention).__name__ == expected
    assert _core_attention(model_lib.build_gpt(args, config)) == expected


def test_defaults_keep_megatrons_attention_and_heads():
    from megatron_adacc.training import model as model_lib

    args = parse_train_args(["--no-progress"])  # configs/tiny.toml
    assert args.attention_backend is None and args.group_query_attention is None
    config = model_lib.transformer_config(args, torch.device("cpu"))
    assert config.num_query_groups == config.num_attention_heads == 4
    assert _core_attention(model_lib.build_gpt(args, config)) == "DotProductAttention"


@pytest.mark.parametrize("flags, named", [
    (["--num-query-groups", "2"], "--num-query-groups 2 takes effect only with --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 does not divide"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups 0 must be a positive integer"),
])
def test_query_groups_are_checked_before_anything_is_built(flags, named):
    with pytest.raises(AdaccError, match=named):
        parse_train_args(["--config", "tiny", "--no-progress"] + flags)


def test_attention_dropout_with_sdpa_on_the_cpu_is_refused_before_the_model_is_built():
    args = parse_train_args(["--config", "tiny", "--attention-backend", "flash", "--device", "cpu", "--no-progress"])
    with pytest.raises(AdaccError, match="--attention-dropout 0.1: .* use --attention-dropout 0"):
        train(args)


def test_a_config_naming_an_unknown_backend_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('attention_backend = "sdpa"\n')
    with pytest.raises(AdaccError, match="attention_backend = 'sdpa' must be one of flash, fused, unfused"):
        parse_train_args(["--config", str(bad)])
