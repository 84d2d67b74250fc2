"""Batches of the training corpus (``--corpus``, see :mod:`.corpus`) as byte-level tokens.

The default corpus, `pydoc_data.topics` (Python's reference documentation, ~466 KB), ships with every CPython
install, so `adacc train` needs no download. Tokens are UTF-8 bytes (vocabulary 256), or, at a larger
``--vocab-size``, each byte with the byte before it, folded into that vocabulary: ids spread over an embedding and
logits of a real tokenizer's size, and the text stays as learnable as the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from megatron_adacc.training.corpus import VOCAB_SIZE, corpus_text, token_vocab


def token_ids(windows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Ids of byte ``windows`` ``[b, n]``: the bytes themselves at the byte vocabulary; at a larger one, ``n - 1``
    ids, each a byte and the one before it, folded into ``vocab_size`` (the first byte only gives context)."""
    if vocab_size == VOCAB_SIZE:
        return windows
    return (windows[:, :-1] * VOCAB_SIZE + windows[:, 1:]) % vocab_size


@lru_cache(maxsize=2)
def corpus_tokens(corpus: str = "embedded") -> torch.Tensor:
    """The whole corpus as a 1-D uint8 tensor of byte values (batches widen to int64: a 5 MB corpus held as
    int64 would add 40 MB to every process's memory)."""
    return torch.frombuffer(bytearray(corpus_text(corpus).encode("utf-8")), dtype=torch.uint8)


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] input ids
    labels: torch.Tensor  # [b, s] next-token targets
    position_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor  # [1, 1, s, s] bool, True = masked out (Megatron's convention)

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device) for t in (self.tokens, self.labels, self.position_ids, self.attention_mask)))


class BatchSampler:
    """Random windows of the corpus, reproducible from a seed; the last 5% is held out for validation.

    In data parallel, each rank draws from its own stream (seed + rank), as a distributed sampler would.
    """

    def __init__(self, seq_length: int, micro_batch_size: int, seed: int, split: str = "train",
                 rank: int = 0, corpus: str = "embedded", vocab_size: int = VOCAB_SIZE):
        if vocab_size < VOCAB_SIZE:
            raise ValueError(f"a vocabulary of {vocab_size} cannot hold the text's {VOCAB_SIZE} byte values")
        self.vocab_size = vocab_size
        # each window's ids need one byte of context before them at a vocabulary beyond the bytes
        self.span = seq_length + 1 + (vocab_size != VOCAB_SIZE)
        tokens = corpus_tokens(corpus)
        cut = int(len(tokens) * 0.95)
        self.tokens = tokens[:cut] if split == "train" else tokens[cut:]
        if len(self.tokens) <= self.span:
            raise ValueError(f"--seq-length {seq_length} is longer than the {split} corpus")
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.generator = torch.Generator().manual_seed(seed * 1000 + rank + (0 if split == "train" else 7))
        self.mask = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]
        self.position_ids = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        starts = torch.randint(0, len(self.tokens) - self.span, (self.micro_batch_size,), generator=self.generator)
        windows = torch.stack([self.tokens[s: s + self.span] for s in starts.tolist()]).to(torch.int64)
        ids = token_ids(windows, self.vocab_size)
        return Batch(ids[:, :-1], ids[:, 1:], self.position_ids, self.mask)


def sampler_for(args: object, *, split: str = "train", rank: int = 0, seed: int | None = None) -> BatchSampler:
    """The batches ``adacc train`` draws for ``args``: its corpus, sequence, micro-batch and vocabulary, from
    ``seed`` (default ``--seed``)."""
    return BatchSampler(args.seq_length, args.micro_batch_size, args.seed if seed is None else seed, split=split,
                        rank=rank, corpus=getattr(args, "corpus", "embedded"), vocab_size=token_vocab(args))
