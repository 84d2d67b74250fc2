"""Adacc's entry in the plugin registry: ``--adacc-policy`` and its flags, what it refuses, what it builds."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from megatron_adacc.core.errors import InputNotFound
from megatron_adacc.core.features import Feature, require, saved_tensor_hook_problems
from megatron_adacc.core.units import checked, parse_positive_bytes, positive_int

#: ``--adacc-policy`` values that are not files. ``keep``, ``recompute`` and ``quantize-all`` are
#: :data:`megatron_adacc.adacc.policy.policy.PRESET_NAMES`; ``none`` and ``auto`` are the feature's own.
NONE, AUTO = "none", "auto"


def _presets() -> tuple[str, ...]:
    from megatron_adacc.adacc.policy.policy import PRESET_NAMES

    return PRESET_NAMES


def _is_preset(value: str) -> bool:
    from megatron_adacc.adacc.policy.policy import preset_key

    return preset_key(value) is not None


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


_HEADROOM = checked(float, lambda f: 0 <= f < 1, "a fraction in [0, 1)")
def _tiles(text: str) -> int:
    from megatron_adacc.adacc.policy.ops import MAX_TILES

    return checked(int, lambda n: 1 <= n <= MAX_TILES, f"a whole number from 1 to {MAX_TILES}")(text)


def _path(text: str) -> str:
    if not text.strip():  # an empty path would fall back to the default database without a word
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return text


def _codec_family(text: str) -> str:
    from megatron_adacc.adacc.policy.ops import CODEC_FAMILIES

    if text not in CODEC_FAMILIES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(CODEC_FAMILIES)}")
    return text


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("adacc", "Adacc: per-tensor keep / compress / recompute")
    # The presets are not imported here: adding flags must stay cheap (they are checked once the flag is on).
    g.add_argument("--adacc-policy", default=NONE, metavar="none|auto|PRESET|PATH",
                   help="Activation policy. none: stock Megatron (nothing installed). auto: profile if needed, "
                        "solve the MILP under --adacc-memory-budget, train. keep / recompute / quantize-all: "
                        "the all-keep, all-recompute and INT4-everywhere presets. PATH: a policy JSON file "
                        "(`adacc solve` writes one).")
    g.add_argument("--adacc-memory-budget", type=parse_positive_bytes, default=None, metavar="BYTES",
                   help="Memory budget for --adacc-policy auto (e.g. 30GiB): the peak of PyTorch's allocated "
                        "bytes on CUDA, of resident memory on the CPU (docs/choosing-a-budget.md). Default: 90%% "
                        "of what the GPU has beyond the CUDA context and other processes; the CPU's available "
                        "RAM.")
    g.add_argument("--adacc-memory-headroom", type=_HEADROOM, default=None, metavar="FRACTION",
                   help="Fraction of the budget the solver leaves free for what its cost model does not see "
                        "(allocator fragmentation, run-to-run variation of the peak). Default: 0.01, and at "
                        "least 8 MiB; a fraction given here is taken as it is.")
    g.add_argument("--adacc-process-baseline", dest="adacc_process_baseline_bytes", type=parse_positive_bytes,
                   default=None, metavar="BYTES",
                   help="Memory the process holds besides what the cost model counts (CPU: interpreter, "
                        "libraries, allocator and framework buffers; peak RSS is the budget there). Default "
                        "on CPU: the resident size measured before solving, which misses buffers created "
                        "later; benchmarks set it from a measured keep-all run.")
    g.add_argument("--adacc-profile-db", type=_path, default=None, metavar="PATH",
                   help="SQLite database of profiled op costs, reused across runs. Default: "
                        "$ADACC_PROFILE_DB or ~/.cache/megatron-adacc/profile.sqlite.")
    g.add_argument("--adacc-no-evolution", action="store_true",
                   help="Turn off adaptive policy evolution (exponential-backoff re-solving as outlier "
                        "statistics drift). For ablations.")
    g.add_argument("--adacc-evolution-cap", type=positive_int, default=1024, metavar="ITERS",
                   help="Longest interval between two tracking iterations of policy evolution.")
    g.add_argument("--adacc-outlier-z", type=_outlier_z, default=3.0, metavar="Z",
                   help="Z-score threshold that separates outlier channels in outlier-separated INT4.")
    g.add_argument("--adacc-no-outlier-separation", action="store_true",
                   help="Compress the tensors that take outlier-separated INT4 (Linear, LayerNorm and GELU "
                        "inputs) with plain per-token INT4 instead: the paper's 'Adacc w/o outlier' ablation.")
    # default None (int4): argparse passes a string default through ``type``, which would import the policy code.
    g.add_argument("--adacc-codec", type=_codec_family, default=None, metavar="int4|gact|none",
                   help="Codec family for tensors the policy compresses: int4 (default), the paper's "
                        "layer-specific INT4 codecs; gact, GACT's adaptive-bit stochastic quantizer; or none "
                        "(auto only keeps or recomputes: lossless, training is bit-identical to stock Megatron).")
    g.add_argument("--adacc-predict-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="Profile each layer's per-op sizes at its first forward, to report predicted bytes beside "
                        "the measured ones. It costs one extra layer forward at step 1, which raises the peak, so "
                        "by default it runs only for policies without the solver's prediction (presets, "
                        "hand-written files); a solved policy (auto) reports the solver's.")
    g.add_argument("--adacc-trace-backward", action="store_true",
                   help="Measure the peak memory of every backward stage (one op of one layer) of each step's first "
                        "micro-batch and report the last step's beside the cost model's prediction (CPU, Linux). "
                        "It sets glibc's mmap threshold to 64 KiB, which slows the run: a measuring tool.")
    g.add_argument("--adacc-mlp-tiles", type=_tiles, default=8, metavar="N",
                   help="MILP: also weigh policies that re-run the MLP in N token tiles in backward, whose "
                        "re-materialized MLP is 1/N as large, and take them where they fit a budget nothing else "
                        "does or are faster. They sum the MLP's weight gradients over the tiles (equal up to float "
                        "rounding); 1 turns them off. Default 8.")
    g.add_argument("--adacc-chain-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="MILP: charge a whole recompute segment when an op's input is also recomputed "
                        "(--no-adacc-chain-aware gives the paper's per-op cost).")
    g.add_argument("--adacc-heterogeneous", action=argparse.BooleanOptionalAction, default=True,
                   help="MILP: let layers pick different Pareto-optimal policies "
                        "(--no-adacc-heterogeneous gives the paper's one policy for all layers).")


def problems(args: Any) -> list[str]:
    found = saved_tensor_hook_problems("--adacc-policy", args)
    if getattr(args, "recompute_granularity", None) is not None:
        found.append("--adacc-policy decides recomputation per tensor itself; drop --recompute-granularity (and "
                     "--recompute-method, --recompute-num-layers, --recompute-activations), or use "
                     "--adacc-policy recompute for Megatron-style full recompute")
    # adacc train has no --transformer-impl: it always builds the local layer.
    if getattr(args, "transformer_impl", "local") != "local":
        found.append("--adacc-policy needs the local layer spec, whose ops it can see one by one; add "
                     "--transformer-impl local")
    if getattr(args, "num_experts", None) is not None:
        found.append("--adacc-policy supports dense GPT layers only; drop --num-experts")
    found += _attention_problems(args)
    tensor = getattr(args, "tensor_model_parallel_size", 1) or 1
    if tensor > 1 and str(getattr(args, "adacc_policy", "")).lower() == "auto":
        found.append(f"--adacc-policy auto cannot plan under --tensor-model-parallel-size {tensor}: its profiler "
                     "times one layer in a process of its own, which builds the whole layer, not a rank's shard, so "
                     "the policy would be solved for other sizes; use a preset (keep, recompute, quantize-all) or a "
                     "policy file, or --tensor-model-parallel-size 1")
    if getattr(args, "adacc_trace_backward", False) and getattr(args, "device", "cpu") != "cuda":
        from megatron_adacc.adacc.runtime.stages import trace_problem

        problem = trace_problem()
        if problem is not None:
            found.append(problem)
    return found


def _attention_problems(args: Any) -> list[str]:
    """Megatron-LM's local layer builds megatron-core's DotProductAttention whatever --attention-backend says (its
    --spec is what swaps the layer): profiling the SDPA layer the flag names would solve for another model."""
    from megatron_adacc.models import SDPA, SDPA_SPEC_FLAG, backend_kind

    backend = getattr(args, "attention_backend", None)
    if getattr(args, "transformer_impl", None) != "local" or getattr(args, "spec", None) or backend is None:
        return []
    if backend_kind(backend) != SDPA:
        return []
    name = getattr(backend, "name", backend)
    return [f"--attention-backend {name}: Megatron-LM's local layer (--transformer-impl local) builds megatron-core's "
            f"DotProductAttention for every backend; for PyTorch's SDPA attention add {' '.join(SDPA_SPEC_FLAG)}, "
            "or drop --attention-backend"]


def preflight(args: Any) -> None:
    """A policy file that is not there fails now, not after model construction."""
    value = args.adacc_policy
    named = value.replace("_", "-").lower() in (NONE, AUTO) or _is_preset(value)
    if not named and not os.path.isfile(value):
        raise InputNotFound(
            f"--adacc-policy {value!r} is neither auto, a preset ({', '.join(_presets())}) nor an existing "
            "policy file; make one with `adacc solve`, or pass --adacc-policy auto")
    require(FEATURE, "megatron_adacc.adacc.integration.extension", "build_extensions")


def build_extensions(args: Any, config: Any) -> list:
    return require(FEATURE, "megatron_adacc.adacc.integration.extension", "build_extensions")(args, config)


FEATURE = Feature(
    name="adacc", flag="--adacc-policy", dest="adacc_policy", off=NONE,
    add_args=add_args, build_extensions=build_extensions, problems=problems, preflight=preflight,
    conflicts={"gact": "--adacc-policy and --gact-level both compress saved activations with saved-tensor hooks "
                       "and cannot be stacked; use one, or --adacc-codec gact to let Adacc use GACT's quantizer "
                       "for the tensors it compresses"},
    flag_prefixes=("--adacc-",),
)
