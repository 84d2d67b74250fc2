"""Command-line flags, in Megatron-LM's style.

Two groups of flags live here:

* :func:`add_adacc_args` — our own flags (``--adacc-*``, ``--resireduce*``, ``--grad-compress*``, ``--gact-*``,
  ``--adama``). Megatron-LM's ``pretrain_gpt.py`` receives exactly these through the patched
  ``extra_args_provider`` (see ``megatron_adacc.megatron_lm``), so they must never collide with Megatron's.
* :func:`add_megatron_args` — the subset of Megatron-LM's own flags that ``adacc train`` understands, with the
  same names and meanings, so a command line moves between the two unchanged.
"""

from __future__ import annotations

import argparse
import math
import re

ADACC_POLICY_PRESETS = ("none", "auto", "keep", "recompute", "quantize-all")
RESIREDUCE_SCHEMES = ("off", "residual", "a", "w", "d", "2d", "w+2d")
GRAD_COMPRESSORS = ("topk", "dgc", "qsgd")
GACT_LEVELS = ("L0", "L1", "L2", "CB1", "CB2")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"12GiB"`` -> 12884901888; ``"500MB"`` -> 500000000; plain integers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size: write a number of bytes or use a unit, e.g. 12GiB, 800MB, 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _outlier_z(text: str) -> float:
    value = _positive_float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"expected a finite Z-score, got {text}; to turn outlier separation off use "
            "--adacc-no-outlier-separation")
    return value


def _density(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--grad-compress-density must be in (0, 1], got {text}")
    return value


def add_adacc_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-adacc's own flags. Safe to call on Megatron-LM's parser: no name overlaps Megatron's."""
    g = parser.add_argument_group("adacc", "Adacc: per-tensor keep / compress / recompute")
    g.add_argument("--adacc-policy", default="none", metavar="none|auto|keep|recompute|quantize-all|PATH",
                   help="Activation policy. none: stock Megatron (nothing installed). auto: profile if needed, "
                        "solve the MILP under --adacc-memory-budget, train. keep / recompute / quantize-all: "
                        "the all-keep, all-recompute and INT4-everywhere presets. PATH: a policy JSON file "
                        "(`adacc solve` writes one).")
    g.add_argument("--adacc-memory-budget", type=parse_bytes, default=None, metavar="BYTES",
                   help="Memory budget for --adacc-policy auto (e.g. 30GiB). Default: the device's memory "
                        "(CUDA: total memory of the current GPU; CPU: available RAM).")
    g.add_argument("--adacc-memory-headroom", type=float, default=0.01, metavar="FRACTION",
                   help="Fraction of the budget the solver leaves free for what its cost model does not see "
                        "(allocator fragmentation, run-to-run variation of the peak). Default 0.01.")
    g.add_argument("--adacc-process-baseline", dest="adacc_process_baseline_bytes", type=parse_bytes, default=None,
                   metavar="BYTES",
                   help="Memory the process holds besides what the cost model counts (CPU: interpreter, "
                        "libraries, allocator and framework buffers; peak RSS is the budget there). Default "
                        "on CPU: the resident size measured before solving, which misses buffers created "
                        "later; benchmarks set it from a measured keep-all run.")
    g.add_argument("--adacc-profile-db", default=None, metavar="PATH",
                   help="SQLite database of profiled op costs, reused across runs. Default: "
                        "$ADACC_PROFILE_DB or ~/.cache/megatron-adacc/profile.sqlite.")
    g.add_argument("--adacc-no-evolution", action="store_true",
                   help="Turn off adaptive policy evolution (exponential-backoff re-solving as outlier "
                        "statistics drift). For ablations.")
    g.add_argument("--adacc-evolution-cap", type=int, default=1024, metavar="ITERS",
                   help="Longest interval between two tracking iterations of policy evolution.")
    g.add_argument("--adacc-outlier-z", type=_outlier_z, default=3.0, metavar="Z",
                   help="Z-score threshold that separates outlier channels in outlier-separated INT4.")
    g.add_argument("--adacc-no-outlier-separation", action="store_true",
                   help="Compress the tensors that take outlier-separated INT4 (Linear, LayerNorm and GELU "
                        "inputs) with plain per-token INT4 instead: the paper's 'Adacc w/o outlier' ablation.")
    g.add_argument("--adacc-codec", choices=("int4", "gact"), default="int4",
                   help="Codec family for tensors the policy compresses: the paper's layer-specific INT4 "
                        "codecs, or GACT's adaptive-bit stochastic quantizer.")
    g.add_argument("--adacc-chain-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="MILP: charge a whole recompute segment when an op's input is also recomputed "
                        "(--no-adacc-chain-aware gives the paper's per-op cost).")
    g.add_argument("--adacc-heterogeneous", action=argparse.BooleanOptionalAction, default=True,
                   help="MILP: let layers pick different Pareto-optimal policies "
                        "(--no-adacc-heterogeneous gives the paper's one policy for all layers).")

    g = parser.add_argument_group("resireduce", "ResiReduce: compressed gradient communication")
    g.add_argument("--resireduce", choices=RESIREDUCE_SCHEMES, default="off",
                   help="Error-feedback residual scheme: off (no compression), residual (plain error "
                        "feedback), a / w (residuals shared across similar layers: average / weighted), "
                        "d / 2d (residuals of specific layers compressed by rows / rows and columns), w+2d.")
    g.add_argument("--grad-compressor", choices=GRAD_COMPRESSORS, default="topk",
                   help="Gradient compressor used when --resireduce is not off.")
    g.add_argument("--grad-compress-density", type=_density, default=0.01, metavar="FRACTION",
                   help="Fraction of gradient entries sent by topk / dgc.")
    g.add_argument("--qsgd-levels", type=int, default=16, metavar="S",
                   help="Quantization levels of the qsgd compressor.")
    g.add_argument("--resireduce-group-size", type=int, default=4, metavar="N",
                   help="Largest number of adjacent similar layers that share one residual (schemes a, w).")
    g.add_argument("--resireduce-phi", type=float, default=0.5, metavar="PHI",
                   help="Weight of the L1 term in ResiReduce-w's layer weights (L2 gets 1 - PHI).")
    g.add_argument("--resireduce-ratio", type=float, default=0.5, metavar="FRACTION",
                   help="Fraction of rows (and columns) of a specific layer's residual kept by d / 2d.")

    g = parser.add_argument_group("gact", "GACT: adaptive-bit activation compression")
    g.add_argument("--gact-level", choices=GACT_LEVELS, default="L0",
                   help="GACT optimization level: L0 off, L1 adaptive bits, L2 L1 + swap to pinned CPU memory, "
                        "CB1 L1 + full recompute of compressed layer inputs, CB2 CB1 + memory-efficient "
                        "attention.")
    g.add_argument("--gact-bits", type=float, default=4.0, metavar="BITS",
                   help="Average bits per activation value for adaptive allocation.")
    g.add_argument("--gact-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="Adaptive per-tensor bits from sensitivity probes (--no-gact-adaptive: every tensor "
                        "at --gact-bits).")
    g.add_argument("--gact-adapt-interval", type=int, default=1000, metavar="ITERS",
                   help="Re-estimate sensitivities and bit widths every ITERS iterations.")
    g.add_argument("--gact-group-size", type=int, default=256, metavar="N",
                   help="Values per quantization group.")

    g = parser.add_argument_group("adama", "AdamA: Adam accumulation")
    g.add_argument("--adama", action="store_true",
                   help="Fold each micro-batch's gradients into Adam's moments during backward and free them "
                        "(no persistent gradient buffer). Global --clip-grad cannot apply (the mini-batch gradient "
                        "never exists); a --clip-grad that only comes from --config is turned off.")
    g.add_argument("--adama-clip-grad-per-tensor", type=float, default=None, metavar="C",
                   help="With --adama: clip each parameter's micro-batch gradient to norm C (default: no clipping).")
    return parser


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Megatron-LM flags `adacc train` understands (same names and meanings as ``pretrain_gpt.py``).

    Model-shape defaults are ``None`` so that values from ``--config`` apply unless the command line names them.
    """
    g = parser.add_argument_group("model", "model shape (defaults come from --config)")
    g.add_argument("--num-layers", type=int, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, help="Hidden size.")
    g.add_argument("--num-attention-heads", type=int, help="Attention heads.")
    g.add_argument("--ffn-hidden-size", type=int, help="Default: 4 x hidden size.")
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
    return parser
