"""The layer and inputs ``--adacc-policy auto`` profiles: a one-layer megatron-core GPT of the configured shape
and the embedding of one batch of text (:class:`~megatron_adacc.adacc.integration.profiler.LayerSample`).

Built here, with megatron-core directly, because both hosts (``adacc train`` and Megatron-LM) reach the profiler
through the same feature entry and neither can hand it their model or data at that point. The model is what
``adacc train`` builds (local layer spec with the core attention of ``--attention-backend``, or Megatron-LM's
``--spec``; the arguments' vocabulary, else the bytes', and embeddings tied unless they say untied) with one
layer, and the batch is the first one ``adacc train``'s sampler draws from its default corpus, Python's reference
documentation, which every CPython install has: the same weights and activations, so the same profile (as bytes:
at a larger vocabulary the ids differ, the layer's sizes do not). ``tests/policy/test_profiler.py`` checks the two
stay equal. Other corpora (``--corpus``) do not change the sample: a stored profile is keyed by
the model signature alone, and is reused whatever text a later run trains on.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron_adacc.adacc.integration.profiler import LayerSample
from megatron_adacc.adacc.policy.signature import args_vocab

#: Tokens are UTF-8 bytes (``adacc train``'s vocabulary without ``--vocab-size``, which ids of a larger one fold).
BYTE_VOCAB = 256
#: ``adacc train`` holds out the corpus's last 5% for validation; the sample comes from the rest.
_TRAIN_FRACTION = 0.95


def one_layer_config(config: Any) -> Any:
    """``config`` with one layer and without Megatron's recompute (the profiler times the layer itself), in a
    model of one pipeline stage: a pipeline stage's layers are the same layer, and the profiler's process has no
    pipeline."""
    one = copy.copy(config)
    one.num_layers, one.pipeline_model_parallel_size = 1, 1
    one.recompute_granularity = None
    one.recompute_method = None
    one.recompute_num_layers = None
    return one


def one_layer_gpt(args: Any, config: Any, device: torch.device) -> torch.nn.Module:
    """megatron-core's ``GPTModel`` with the layer spec the host builds (its core attention included) and
    ``config``'s shape but one layer, in training mode."""
    from megatron.core.models.gpt import GPTModel

    from megatron_adacc.models.attention import layer_spec

    one = one_layer_config(config)
    model = GPTModel(config=one, transformer_layer_spec=layer_spec(args), vocab_size=args_vocab(args) or BYTE_VOCAB,
                     max_sequence_length=args.seq_length, position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights",
                                                                     False))
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(one, model)
    model = model.to(device)
    model.train()
    return model


def text_batch(seq_length: int, micro_batch_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(tokens, position ids, attention mask): random windows of Python's documentation as bytes, drawn as
    ``adacc train``'s first training batch with ``seed`` (rank 0)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    corpus = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    corpus = corpus[:int(len(corpus) * _TRAIN_FRACTION)]
    if len(corpus) <= seq_length + 1:
        raise ValueError(f"--seq-length {seq_length} is longer than the profiling text ({len(corpus)} bytes)")
    generator = torch.Generator().manual_seed(seed * 1000)
    starts = torch.randint(0, len(corpus) - seq_length - 1, (micro_batch_size,), generator=generator)
    windows = torch.stack([corpus[s: s + seq_length + 1] for s in starts.tolist()]).to(torch.int64)
    positions = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
    mask = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]
    return windows[:, :-1], positions, mask


def layer_inputs(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor | None, seq_length: int) -> LayerSample:
    """Layer 0 of a GPT ``model`` (bare or Float16Module-wrapped) with the embedding of ``tokens`` as input."""
    gpt = model.module if hasattr(model, "module") and not hasattr(model, "embedding") else model
    device = next(model.parameters()).device
    with torch.no_grad():
        hidden = gpt.embedding(input_ids=tokens.to(device), position_ids=positions.to(device))
    rope = gpt.rotary_pos_emb(seq_length) if getattr(gpt, "rotary_pos_emb", None) is not None else None
    return LayerSample(layer=gpt.decoder.layers[0], hidden=hidden.detach(),
                       mask=mask.to(device) if mask is not None else None, rope=rope)


def layer_sample(args: Any, config: Any, device: torch.device) -> LayerSample:
    """What ``--adacc-policy auto`` profiles for the model ``args``/``config`` describe (see the module
    docstring). Weights come from the current RNG state, as the model ``adacc train`` then builds."""
    model = one_layer_gpt(args, config, device)
    tokens, positions, mask = text_batch(args.seq_length, args.micro_batch_size, getattr(args, "seed", 1234))
    return layer_inputs(model, tokens, positions, mask, args.seq_length)
