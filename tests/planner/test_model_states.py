"""Static memory from the real model (issue 21, item 3): parameters counted on the meta device as the host builds
the model (vocabulary, untied embeddings, tensor-parallel shards, pipeline stages), bytes per parameter under the
(distributed) optimizer, and the logits workspace at the real vocabulary, as ``auto`` charges them."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_adacc.adacc.integration.model_states import ModelParameters, count_parameters, static_memory
from megatron_adacc.adacc.planner.layout import Layout, fake_groups
from megatron_adacc.adacc.policy.static import in_flight, logits_workspace_bytes, state_bytes
from megatron_adacc.testing import memory_cap


def real_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_count_is_the_model_adacc_train_builds(tiny4) -> None:
    from megatron_adacc.training import model as model_lib

    args, config = tiny4
    counted = count_parameters(args, config)
    with memory_cap(4):
        assert counted.total == real_count(model_lib.build_gpt(args, config))
    assert counted.vocab_per_rank == 256 and counted.tied  # bytes, and one matrix for embedding and logits


def test_a_real_vocabulary_and_untied_embeddings_are_counted(tiny4) -> None:
    """Megatron-LM's padded vocabulary and an output layer of its own: the count is the model megatron-core builds
    for them, the output layer in the head."""
    from megatron.core.models.gpt import GPTModel

    from megatron_adacc.models.attention import gpt_layer_spec

    args, config = tiny4
    args = copy.copy(args)
    args.padded_vocab_size, args.untie_embeddings_and_output_weights = 1024, True
    counted = count_parameters(args, config)
    with memory_cap(4):
        real = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(None), vocab_size=1024,
                        max_sequence_length=32, share_embeddings_and_output_weights=False)
    assert counted.total == real_count(real)
    assert counted.head == real_count(real.output_layer) + real_count(real.decoder.final_layernorm)
    tied = count_parameters(copy.copy(tiny4[0]), config)
    assert counted.embedding - tied.embedding == (1024 - 256) * 64


def test_tensor_parallel_shards_split_what_megatron_splits(tiny4) -> None:
    """Under TP 2 each rank holds half of every matrix and of the vocabulary, and all of the norms and of the
    biases a row-parallel layer adds after its reduction (two LayerNorms' weight and bias, the two output biases)."""
    args, config = tiny4
    one, two = count_parameters(args, config), count_parameters(args, Layout(tensor=2).shard(config),
                                                                fake_groups(Layout(tensor=2)))
    h, replicated = 64, 6 * 64
    assert two.layer == (one.layer - replicated) // 2 + replicated
    assert two.vocab_per_rank == one.vocab_per_rank // 2
    assert two.embedding == one.embedding - 256 * h // 2  # the word embeddings halve; positions do not


def test_pipeline_stages_hold_their_layers_and_their_ends() -> None:
    """The first stage holds the embeddings, the last the final norm and, with tied embeddings, a copy of the word
    embeddings as its output layer; the others only layers."""
    params = ModelParameters(embedding=1000, word_embedding=900, layer=50, head=10, num_layers=8, pipeline_size=4,
                             tied=True, vocab_per_rank=90)
    assert [params.stage(i) for i in range(4)] == [1100, 100, 100, 1010]
    assert sum(params.stage(i) for i in range(4)) == params.total + params.word_embedding
    untied = ModelParameters(1000, 900, 50, 910, 8, 2, tied=False, vocab_per_rank=90)
    assert [untied.stage(i) for i in range(2)] == [1200, 1110]
    assert [in_flight(i, 4) for i in range(4)] == [4, 3, 2, 1] and in_flight(0, 4, num_microbatches=2) == 2


@pytest.mark.parametrize("dtype,distributed,data,expected", [
    ("bfloat16", False, 8, 18), ("bfloat16", True, 8, 6 + 12 / 8), ("float16", False, 4, 20),
    ("float16", True, 4, 4 + 16 / 4), ("float32", False, 2, 16), ("float32", True, 2, 8 + 8 / 2)])
def test_bytes_per_parameter_are_megatrons(dtype, distributed, data, expected) -> None:
    assert state_bytes(dtype, distributed_optimizer=distributed, data_parallel_size=data).total == expected


def test_auto_charges_the_runs_static_memory(tiny4, tmp_path) -> None:
    """Through ``auto``'s own path: a Megatron-LM run (padded vocabulary 1024, untied, bf16, distributed optimizer
    over 4 data-parallel ranks) is charged 6 + 12/4 bytes per parameter of its real model, and fp32 logits and
    their gradient over its vocabulary (the profile reused from the database is charged again for each run)."""
    from megatron_adacc.adacc.integration.auto import get_or_make_profile

    args, config = tiny4
    args = copy.copy(args)
    args.padded_vocab_size, args.untie_embeddings_and_output_weights, args.bf16 = 1024, True, True
    args.use_distributed_optimizer, args.data_parallel_size = True, 4
    args.adacc_profile_db = str(tmp_path / "profiles.sqlite")
    bf16 = copy.copy(config)
    bf16.bf16, bf16.params_dtype = True, torch.bfloat16
    with memory_cap(6):
        profile, _ = get_or_make_profile(args, bf16, log=lambda _line: None)
        counted = count_parameters(args, bf16).total
        assert profile.static_bytes == counted * (6 + 12 / 4)
        assert profile.workspace_bytes == logits_workspace_bytes(1024, 32 * 2) + profile.rng_bytes
        args.data_parallel_size = 1
        reused, _ = get_or_make_profile(args, bf16, log=lambda _line: None)
    assert reused.static_bytes == counted * 18
    assert static_memory(args, bf16).state_bytes == reused.static_bytes
