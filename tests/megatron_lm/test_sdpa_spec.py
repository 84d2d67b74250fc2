"""SDPA attention in Megatron-LM: its local layer ignores ``--attention-backend``, and its own ``--spec MODULE NAME``
selects the layer instead, with or without a megatron-adacc feature on."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import torch

from megatron_adacc.adacc.feature import problems
from megatron_adacc.megatron_lm import configs
from megatron_adacc.models import SDPA_SPEC_FLAG

DATA = Path(__file__).parent / "data"
MEGATRON_FLAGS = {line for line in (DATA / "megatron_lm_flags_d98e8a64.txt").read_text().split()
                  if line.startswith("--")}


def test_llama_tiny_translates_to_megatron_lm_flags_with_the_sdpa_spec():
    argv = configs.to_argv(configs.load("llama-tiny"))
    assert {a for a in argv if a.startswith("--")} <= MEGATRON_FLAGS
    start = argv.index("--spec")
    assert tuple(argv[start:start + 3]) == SDPA_SPEC_FLAG
    assert argv[argv.index("--num-query-groups") + 1] == "2" and "--group-query-attention" in argv
    # the unfused configs get no spec: Megatron-LM's local layer is theirs
    assert "--spec" not in configs.to_argv(configs.load("gpt-345m"))
    own = configs.to_argv({"attention_backend": "flash", "spec": ["my.module", "SPEC"]})  # a config's own spec wins
    assert own.count("--spec") == 1 and own[own.index("--spec") + 1] == "my.module"


def test_the_spec_megatron_lm_imports_builds_the_sdpa_layer():
    """What Megatron-LM's model builders do with ``--spec``: megatron-core's import_module, then GPTModel."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import import_module

    from megatron_adacc.testing import init_distributed_single, tiny_config

    spec = import_module(list(SDPA_SPEC_FLAG[1:]))
    init_distributed_single()
    for normalization, norm in (("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)):
        model = GPTModel(config=tiny_config(normalization=normalization, attention_dropout=0.0),
                         transformer_layer_spec=spec, vocab_size=256, max_sequence_length=32)
        layer = model.decoder.layers[0]
        assert type(layer.self_attention.core_attention).__name__ == "SDPAttention"
        assert type(layer.input_layernorm) is norm and type(layer.pre_mlp_layernorm) is norm


def _megatron_args(**overrides) -> Namespace:
    from megatron.core.transformer.enums import AttnBackend

    values = dict(transformer_impl="local", attention_backend=AttnBackend.auto, spec=None, recompute_granularity=None,
                  num_experts=None, adacc_policy="auto")
    return Namespace(**{**values, **overrides})


@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_adacc_refuses_a_backend_megatron_lms_local_layer_would_ignore(backend):
    from megatron.core.transformer.enums import AttnBackend

    found = problems(_megatron_args(attention_backend=AttnBackend[backend]))
    assert found == [f"--attention-backend {backend}: Megatron-LM's local layer (--transformer-impl local) builds "
                     "megatron-core's DotProductAttention for every backend; for PyTorch's SDPA attention add "
                     "--spec megatron_adacc.models.attention SDPA_LAYER_SPEC, or drop --attention-backend"]
    assert problems(_megatron_args(attention_backend=AttnBackend[backend], spec=list(SDPA_SPEC_FLAG[1:]))) == []
    assert problems(_megatron_args()) == []  # Megatron-LM's default, auto: the local layer's own attention


def test_the_profiled_layer_is_the_one_megatron_lm_builds():
    from megatron_adacc.models.attention import layer_spec

    core = layer_spec(_megatron_args(spec=list(SDPA_SPEC_FLAG[1:]))).submodules.self_attention.submodules
    assert core.core_attention.__name__ == "SDPAttention"
    assert layer_spec(_megatron_args()).submodules.self_attention.submodules.core_attention.__name__ == \
        "DotProductAttention"
