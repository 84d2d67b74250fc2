"""Command-line flags, in Megatron-LM's style.

Two groups of flags live here:

* :func:`add_adacc_args` — our own flags, each feature's from its registry entry (:mod:`megatron_adacc.features`).
  Megatron-LM's ``pretrain_gpt.py`` receives exactly these through the patched ``extra_args_provider`` (see
  ``megatron_adacc.megatron_lm``), so they must never collide with Megatron's.
* :func:`add_megatron_args` — the subset of Megatron-LM's own flags that ``adacc train`` understands, with the
  same names and meanings, so a command line moves between the two unchanged.
"""

from __future__ import annotations

import argparse

from megatron_adacc import features
from megatron_adacc.core.log import level_of
from megatron_adacc.core.units import checked, parse_bytes, positive_int
from megatron_adacc.models import ATTENTION_BACKENDS

__all__ = ["add_adacc_args", "add_megatron_args", "parse_bytes"]

_POSITIVE_MINUTES = checked(float, lambda m: m > 0, "a positive number of minutes")


def _logging_level(text: str) -> int:
    try:
        return level_of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_adacc_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-adacc's own flags: every registered feature's (:data:`megatron_adacc.features.FEATURES`).
    Safe to call on Megatron-LM's parser: no name overlaps Megatron's."""
    return features.add_args(parser)


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Megatron-LM flags `adacc train` understands (same names and meanings as ``pretrain_gpt.py``).

    Model-shape defaults are ``None`` so that values from ``--config`` apply unless the command line names them.
    """
    g = parser.add_argument_group("model", "model shape (defaults come from --config)")
    g.add_argument("--num-layers", type=int, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, help="Hidden size.")
    g.add_argument("--num-attention-heads", type=int, help="Attention heads.")
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="Grouped-query attention: --num-query-groups key/value heads, each shared by a group of "
                        "query heads.")
    g.add_argument("--num-query-groups", type=int,
                   help="Key/value heads under --group-query-attention (default 1); divides --num-attention-heads.")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   help="Core attention of the local layer: flash / fused: PyTorch's fused SDPA kernels (no s x s "
                        "tensors); auto (default), local, unfused: megatron-core's DotProductAttention.")
    g.add_argument("--ffn-hidden-size", type=int, help="Default: 4 x hidden size.")
    g.add_argument("--vocab-size", type=int,
                   help="Vocabulary before padding (as with Megatron-LM's NullTokenizer), at least 256: the text "
                        "becomes ids over this many (each byte with the one before it, folded in), for the "
                        "embedding, output layer and logits of a real tokenizer's size. Default: the 256 bytes.")
    g.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="Pad --vocab-size to a multiple of this (default 128, Megatron-LM's).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="An output layer of its own instead of the input embedding's weights (Llama's).")
    g.add_argument("--seq-length", type=int, help="Tokens per sample.")
    g.add_argument("--hidden-dropout", type=float, help="Dropout after attention and MLP.")
    g.add_argument("--attention-dropout", type=float, help="Dropout on attention probabilities.")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), help="Position embeddings.")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), help="Normalization layer.")
    g.add_argument("--swiglu", action="store_true", default=None, help="SwiGLU MLP instead of GeLU.")
    g.add_argument("--disable-bias-linear", action="store_true", default=None,
                   help="Linear layers without bias.")
    g.add_argument("--bf16", action="store_true", default=None, help="bf16 parameters (fp32 master weights).")

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, help="Samples per forward/backward pass.")
    g.add_argument("--global-batch-size", type=int,
                   help="Samples per optimizer step over all data-parallel ranks; "
                        "global / (micro x data-parallel size) micro-batches are accumulated.")
    g.add_argument("--train-iters", type=int, help="Optimizer steps.")
    g.add_argument("--lr", type=float, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, help="Learning rate at the end of cosine decay.")
    g.add_argument("--lr-warmup-iters", type=int, help="Linear warm-up steps.")
    g.add_argument("--weight-decay", type=float, help="Decoupled weight decay (AdamW).")
    g.add_argument("--clip-grad", type=float, help="Global gradient-norm clipping (0 turns it off).")
    g.add_argument("--seed", type=int, help="Seed for weights, data order and dropout.")
    g.add_argument("--deterministic-mode", action="store_true", default=None,
                   help="Bit-exact reproducible runs (Megatron-LM's flag): megatron-core's deterministic code paths, "
                        "and Adacc's policy evolution switching on outlier statistics alone, never on codec times "
                        "re-measured during training, so that a resumed run switches where the straight one did.")

    g = parser.add_argument_group("recompute", "Megatron's own activation recomputation")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="Megatron recompute: full (layer inputs only) or selective (--recompute-modules).")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="Full recompute: uniform (chunks of --recompute-num-layers) or block (the first N).")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="Layers per chunk / block.")
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="For selective recompute: core_attn, layernorm, mlp (default core_attn).")

    g = parser.add_argument_group("distributed")
    g.add_argument("--overlap-grad-reduce", action="store_true", default=None,
                   help="Start bucket gradient reduction during backward.")
    g.add_argument("--use-distributed-optimizer", action="store_true", default=None,
                   help="Shard optimizer states across data-parallel ranks (reduce-scatter gradients).")
    g.add_argument("--ddp-bucket-size", type=positive_int, default=None, metavar="ELEMENTS",
                   help="Gradient elements per reduction bucket with --overlap-grad-reduce or --adama "
                        "--use-distributed-optimizer (default: Megatron's, max(40M, 1M x data-parallel size)).")
    g.add_argument("--distributed-timeout-minutes", type=_POSITIVE_MINUTES, default=None, metavar="MINUTES",
                   help="How long a collective (and the ranks' start-up meeting) waits for a rank that does not "
                        "answer (stopped, hung) before the job stops, naming that rank (default 10, Megatron-LM's; "
                        "fractions allowed).")

    g = parser.add_argument_group("logging")
    g.add_argument("--logging-level", type=_logging_level, default=None, metavar="LEVEL",
                   help="Megatron-LM's: the lowest level of the lines megatron-adacc prints, a number (10 debug, 20 "
                        "info, the default, 30 warning, 40 error) or its name. `adacc -q` / `-v` win over it.")
    return parser
