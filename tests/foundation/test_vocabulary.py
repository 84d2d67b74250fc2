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


def test_auto_profiles_the_vocabulary_and_embeddings_the_run_builds():
    from megatron_adacc.adacc.integration.sample import layer_sample

    args, config, _ = _built(LLAMA_VOCAB)
    sample = layer_sample(args, config, torch.device("cpu"))
    assert sample.vocab_size == 32128  # the logits workspace a profile charges is this vocabulary's
    _, _, model = _built(LLAMA_VOCAB)
    embeddings = 2 * 32128 * 64  # the input embedding and the output layer, one layer fewer than the model
    assert sample.model_params == sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in model.decoder.layers[1].parameters())
    assert sample.model_params > embeddings


@pytest.mark.parametrize("flags, named", [
    (["--vocab-size", "100"], "--vocab-size 100: the text is bytes, which need 256 ids"),
    (["--vocab-size", "0"], "--vocab-size 0 must be a positive integer"),
    (["--vocab-size", "1000", "--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by 0 must be"),
])
def test_vocabularies_the_text_cannot_fill_are_refused_before_anything_is_built(flags, named):
    with pytest.raises(AdaccError, match=named):
        parse_train_args(SMALL + flags)
