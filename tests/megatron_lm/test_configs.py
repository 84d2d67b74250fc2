"""configs/gpt-*.toml: the paper's three models, readable by `adacc train` and turned into Megatron-LM flags."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megatron_adacc.megatron_lm import configs

DATA = Path(__file__).parent / "data"
MEGATRON_FLAGS = {line for line in (DATA / "megatron_lm_flags_d98e8a64.txt").read_text().split()
                  if line.startswith("--")}
PADDED_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128, as Megatron-LM does

# name: (nominal parameters, tolerance). GPT-2 small is called 117M but has 124M parameters with tied embeddings.
MODELS = {"gpt-117m": (117e6, 0.07), "gpt-345m": (345e6, 0.04), "gpt-4.7b": (4.7e9, 0.02)}


def gpt_parameters(c: dict) -> int:
    h, layers, ffn = c["hidden_size"], c["num_layers"], c["ffn_hidden_size"]
    per_layer = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h  # attention, MLP, two LayerNorms
    return layers * per_layer + (PADDED_VOCAB + c["seq_length"]) * h + 2 * h  # embeddings, final LayerNorm


@pytest.mark.parametrize("name", MODELS)
def test_sizes_match_the_paper(name):
    c = configs.load(name)
    nominal, tolerance = MODELS[name]
    assert abs(gpt_parameters(c) / nominal - 1) < tolerance
    assert c["hidden_size"] % c["num_attention_heads"] == 0
    assert c["global_batch_size"] == 8 * c["micro_batch_size"]  # 8 GPUs, data parallel, as in the paper


def test_parameter_formula_on_a_hand_computed_case():
    c = {"hidden_size": 2, "num_layers": 1, "ffn_hidden_size": 8, "seq_length": 3}
    # attention 4*4+4*2=24, MLP 2*2*8+8+2=42, LayerNorms 4*2=8 -> 74; embeddings (50304+3)*2; final LN 4
    assert gpt_parameters(c) == 74 + 50307 * 2 + 4


@pytest.mark.parametrize("name", MODELS)
def test_adacc_train_reads_them(name):
    from megatron_adacc.training.args import parse_train_args

    args = parse_train_args(["--config", name])
    assert args.num_layers == configs.load(name)["num_layers"] and args.use_distributed_optimizer is True


@pytest.mark.parametrize("name", MODELS)
def test_every_flag_exists_in_megatron_lm(name):
    argv = configs.to_argv(configs.load(name))
    flags = [a for a in argv if a.startswith("--")]
    assert flags and set(flags) <= MEGATRON_FLAGS
    assert argv[argv.index("--max-position-embeddings") + 1] == "1024"


def test_to_argv_rules():
    argv = configs.to_argv({"bf16": True, "swiglu": False, "seq_length": 16, "lr": 1e-4,
                            "recompute_modules": ["core_attn", "mlp"], "position_embedding_type": "rope"})
    # No --max-position-embeddings: rotary positions need none.
    assert argv == ["--bf16", "--seq-length", "16", "--lr", "0.0001", "--recompute-modules", "core_attn", "mlp",
                    "--position-embedding-type", "rope"]
    with pytest.raises(ValueError, match="cannot turn a dict"):
        configs.to_argv({"bad": {"a": 1}})


def test_cli_overrides_and_drops(capsys):
    assert configs.main(["gpt-345m", "--set", "micro_batch_size=16", "--set", "spec=local",
                         "--drop", "use-distributed-optimizer"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[argv.index("--micro-batch-size") + 1] == "16" and argv[argv.index("--spec") + 1] == "local"
    assert "--use-distributed-optimizer" not in argv


def test_unknown_config_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="gpt-345m"):
        configs.resolve("gpt-9000b")
