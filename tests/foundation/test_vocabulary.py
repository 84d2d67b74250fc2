"""`adacc train --vocab-size` and `--untie-embeddings-and-output-weights` (issue 20, item 4): a model of a real
tokenizer's vocabulary (padded as Megatron-LM pads it) with its own output layer, trained on the byte corpus
folded into that vocabulary, profiled and signed as built."""

import math

import pytest
import torch

from megatron_adacc.adacc.policy.signature import model_signature
from megatron_adacc.core.errors import AdaccError
from megatron_adacc.training import model as model_lib
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.data import VOCAB_SIZE, BatchSampler
from megatron_adacc.training.loop import train

SMALL = ["--config", "tiny", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--no-progress"]
LLAMA_VOCAB = ["--vocab-size", "32001", "--untie-embeddings-and-output-weights"]


def _built(flags):
    from megatron_adacc.testing import init_distributed_single

    init_distributed_single()
    args = parse_train_args(SMALL + flags)
    config = model_lib.transformer_config(args, torch.device("cpu"))
    return args, config, model_lib.build_gpt(args, config)


def test_the_model_has_the_padded_vocabulary_and_its_own_output_layer():
    args, config, model = _built(LLAMA_VOCAB)
    assert (args.vocab_size, args.padded_vocab_size) == (32001, 32128)  # Megatron-LM's multiple of 128
    assert model.embedding.word_embeddings.weight.shape[0] == model.output_layer.weight.shape[0] == 32128
    assert not model.share_embeddings_and_output_weights
    assert model.output_layer.weight.data_ptr() != model.embedding.word_embeddings.weight.data_ptr()
    signature = model_signature(config, args)
    assert (signature["vocab_size"], signature["untie_embeddings_and_output_weights"]) == (32128, True)
    args, config, model = _built(["--make-vocab-size-divisible-by", "64"] + LLAMA_VOCAB)
    assert args.padded_vocab_size == 32064
    _, config, model = _built([])  # the bytes, tied, as before; the signature leaves the vocabulary out
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None
    assert model_signature(config, parse_train_args(SMALL))["vocab_size"] is None


def test_batches_spread_over_the_vocabulary_and_stay_text():
    """Each id is a byte and the one before it, folded in: ids beyond the bytes, every label the next token's
    id, and the byte vocabulary's batches as they always were."""
    sampler = BatchSampler(64, 4, seed=3, vocab_size=32001)
    wide = next(sampler)
    assert wide.tokens.max() >= VOCAB_SIZE and wide.tokens.max() < 32001 and wide.tokens.min() >= 0
    assert torch.equal(wide.labels[:, :-1], wide.tokens[:, 1:])
    assert not torch.equal(next(sampler).tokens, wide.tokens)
    byte = next(BatchSampler(64, 4, seed=3))
    assert byte.tokens.max() < VOCAB_SIZE and torch.equal(byte.labels[:, :-1], byte.tokens[:, 1:])


def test_a_short_run_starts_at_the_vocabulary_s_entropy_and_learns():
    summary = train(parse_train_args(SMALL + LLAMA_VOCAB + ["--train-iters", "6", "--lr", "3e-3"]))
    losses = summary["losses"]
    assert abs(losses[0] - math.log(32128)) < 1.0  # uniform over the padded vocabulary at initialization
    assert losses[-1] < losses[0]


def test_auto_charges_the_vocabulary_and_embeddings_the_run_builds():
    """What ``auto`` counts beside the activations comes from the model the run builds: its padded vocabulary in the
    logits workspace, and untied input and output embeddings in the model states."""
    from megatron_adacc.adacc.integration.model_states import count_parameters, static_memory
    from megatron_adacc.adacc.policy.static import logits_workspace_bytes

    args, config, model = _built(LLAMA_VOCAB)
    parameters = count_parameters(args, config)
    assert parameters.vocab_per_rank == 32128 and not parameters.tied
    assert parameters.total == sum(p.numel() for p in model.parameters())
    assert parameters.total > 2 * 32128 * 64  # the input embedding and the output layer
    static = static_memory(args, config, parameters=parameters)
    assert static.workspace_bytes == logits_workspace_bytes(32128, args.seq_length * args.micro_batch_size)


@pytest.mark.parametrize("flags, named", [
    (["--vocab-size", "100"], "--vocab-size 100: the text is bytes, which need 256 ids"),
    (["--vocab-size", "0"], "--vocab-size 0 must be a positive integer"),
    (["--vocab-size", "1000", "--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by 0 must be"),
])
def test_vocabularies_the_text_cannot_fill_are_refused_before_anything_is_built(flags, named):
    with pytest.raises(AdaccError, match=named):
        parse_train_args(SMALL + flags)
