"""Which megatron-adacc features a Megatron-LM command line turns on, and which combinations cannot work.

Everything here reads the parsed ``args`` Namespace only: it runs before Megatron initializes anything, so a
bad combination fails in the first second instead of after model construction.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class IntegrationError(ValueError):
    """A megatron-adacc flag cannot work with the rest of the Megatron-LM command line."""


class FeatureUnavailable(ImportError):
    """A flag asks for a feature whose module this installation of megatron-adacc lacks."""


@dataclass(frozen=True)
class Feature:
    """One user-visible feature: the flag that turns it on and the value that means "off"."""

    name: str
    flag: str
    dest: str
    off: Any

    def is_enabled(self, args: Any) -> bool:
        return getattr(args, self.dest, self.off) != self.off


ADACC = Feature("adacc", "--adacc-policy", "adacc_policy", "none")
RESIREDUCE = Feature("resireduce", "--resireduce", "resireduce", "off")
GACT = Feature("gact", "--gact-level", "gact_level", "L0")
ADAMA = Feature("adama", "--adama", "adama", False)
FEATURES: tuple[Feature, ...] = (ADACC, RESIREDUCE, GACT, ADAMA)

_OUR_FLAG_PREFIXES = ("--adacc-", "--resireduce", "--grad-compress", "--gact-", "--adama", "--qsgd-")


def enabled_features(args: Any) -> list[Feature]:
    """The features ``args`` turns on, in the order they are set up."""
    _require_our_args(args)
    return [f for f in FEATURES if f.is_enabled(args)]


def _require_our_args(args: Any, argv: list[str] | None = None) -> None:
    """Refuse a Namespace that lost our flags although the command line had them.

    Megatron-LM's ``--yaml-cfg`` path replaces the parsed Namespace by the YAML file's contents, dropping
    every extra flag; without this check ``--adacc-policy auto`` would silently train the stock model.
    """
    if hasattr(args, ADACC.dest):
        return
    argv = sys.argv[1:] if argv is None else argv
    given = [a.split("=")[0] for a in argv if a.startswith(_OUR_FLAG_PREFIXES)]
    if given:
        raise IntegrationError(
            f"{', '.join(given)} were given but the parsed arguments do not contain them: Megatron-LM's "
            "--yaml-cfg replaces the command line by the YAML file. Put the megatron-adacc flags on the "
            "command line without --yaml-cfg."
        )


def _set(args: Any, dest: str, default: Any = None) -> Any:
    return getattr(args, dest, default)


def check_combination(args: Any, features: list[Feature]) -> None:
    """Raise :class:`IntegrationError` naming the flag to change when ``features`` cannot run with
    ``args``."""
    names = {f.name for f in features}
    problems: list[str] = []

    if _set(args, "inprocess_restart", False):
        problems.append("megatron-adacc attaches to the model once per process; --inprocess-restart "
                        "rebuilds it in the same process. Drop --inprocess-restart")
    if {"adacc", "gact"} <= names:
        problems.append("--adacc-policy and --gact-level both compress saved activations with saved-tensor "
                        "hooks and cannot be stacked; use one, or --adacc-codec gact to let Adacc use GACT's "
                        "quantizer for the tensors it compresses")
    if {"adama", "resireduce"} <= names:
        problems.append("--adama folds gradients into Adam's moments during backward and all-reduces the "
                        "moments, so there is no gradient left for --resireduce to compress; use one of them")

    if names & {"adacc", "gact"}:
        which = "--adacc-policy" if "adacc" in names else "--gact-level"
        if _set(args, "fine_grained_activation_offloading", False):
            problems.append(f"{which} cannot run with --fine-grained-activation-offloading (both own the "
                            "saved-tensor hooks); drop --fine-grained-activation-offloading")
        if _set(args, "cuda_graph_impl", "none") not in (None, "none"):
            problems.append(f"{which} cannot run inside CUDA graphs; use --cuda-graph-impl none")
        if _set(args, "fp8") is not None or _set(args, "fp4") is not None:
            problems.append(f"{which} compresses 16/32-bit activations; drop --fp8-format / --fp4-format")

    if "gact" in names and (_set(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        problems.append("--gact-level probes gradients with a plain forward and backward of one batch, which "
                        "pipeline parallelism cannot run; use --pipeline-model-parallel-size 1")

    if "adacc" in names:
        if _set(args, "recompute_granularity") is not None:
            problems.append("--adacc-policy decides recomputation per tensor itself; drop "
                            "--recompute-granularity (and --recompute-method, --recompute-num-layers, "
                            "--recompute-activations), or use --adacc-policy recompute for Megatron-style "
                            "full recompute")
        if _set(args, "transformer_impl", "transformer_engine") != "local":
            problems.append("--adacc-policy needs the local layer spec, whose ops it can see one by one; add "
                            "--transformer-impl local")
        if _set(args, "num_experts") is not None:
            problems.append("--adacc-policy supports dense GPT layers only; drop --num-experts")

    if "resireduce" in names:
        if _set(args, "use_megatron_fsdp", False) or _set(args, "use_torch_fsdp2", False):
            problems.append("--resireduce compresses Megatron DDP's bucket reduction; FSDP reduces gradients "
                            "elsewhere. Drop --use-megatron-fsdp / --use-torch-fsdp2")
        if (_set(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
            problems.append("--resireduce does not support --num-distributed-optimizer-instances > 1")

    if "adama" in names:
        if _set(args, "gradient_accumulation_fusion", False):
            problems.append("--adama needs each micro-batch's gradient in param.grad, but gradient "
                            "accumulation fusion writes it straight into main_grad; add "
                            "--no-gradient-accumulation-fusion")
        if _set(args, "calculate_per_token_loss", False):
            problems.append("--adama folds each micro-batch gradient as it is produced and cannot rescale it by "
                            "the token count afterwards; drop --calculate-per-token-loss")
        if (_set(args, "save") or _set(args, "load")) and _set(args, "ckpt_format", "torch_dist") != "torch":
            problems.append("--adama checkpoints its moments as a plain torch state dict; add --ckpt-format torch "
                            "(Megatron's distributed checkpoint format is not implemented for AdamA)")
        # --use-distributed-optimizer, --overlap-grad-reduce, --clip-grad, --fp16 ...: AdamA's own
        # megatron_adacc.optim.megatron.check_supported, called by configure() right after this.

    if problems:
        raise IntegrationError("megatron-adacc cannot run this command line:\n  - " + "\n  - ".join(problems))


def load(feature: Feature, module: str, attr: str) -> Callable[..., Any]:
    """Import ``module.attr`` for ``feature`` only now that its flag is set, or say clearly why not."""
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise FeatureUnavailable(
            f"{feature.flag} needs {module}.{attr}, which this installation of megatron-adacc cannot provide "
            f"({type(exc).__name__}: {exc}). Reinstall megatron-adacc (`pip install -e .` from the "
            f"repository, with its compiled extension), or run without {feature.flag}."
        ) from exc
