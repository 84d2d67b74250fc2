"""AdamA's entry in the plugin registry: ``--adama`` and its flags, what it refuses, what it builds."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.core.features import Feature, require
from megatron_adacc.core.units import checked

_POSITIVE_NORM = checked(float, lambda c: c > 0, "a positive norm")  # AdamA's own check, at parse time


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("adama", "AdamA: Adam accumulation")
    g.add_argument("--adama", action="store_true",
                   help="Fold each micro-batch's gradients into Adam's moments during backward and free them (no "
                        "gradient buffer). Data parallel: m and v replicated and all-reduced once per step (AdamA "
                        "over N x DP micro-batches), or with --use-distributed-optimizer sharded like Megatron's "
                        "(m, v, fp32 master: 12/DP bytes per parameter, no 4-byte gradient buffer; bf16: 2 + 12/DP "
                        "against Megatron's 6 + 12/DP), each micro-batch's gradient reduce-scattered to its owner "
                        "(AdamA over N micro-batches of DP x micro-batch samples; Adam when N = 1). --clip-grad C "
                        "needs --use-distributed-optimizer: it clips each micro-batch's gradient to global norm C "
                        "(not the summed gradient: that never exists); a --clip-grad that only comes from "
                        "--config is turned off without it. See docs/adama.md.")
    g.add_argument("--adama-clip-grad-per-tensor", type=_POSITIVE_NORM, default=None, metavar="C",
                   help="With --adama (replicated states): clip each parameter's micro-batch gradient to norm C "
                        "(default: no clipping).")


def problems(args: Any) -> list[str]:
    found = []
    if getattr(args, "gradient_accumulation_fusion", False):
        found.append("--adama needs each micro-batch's gradient in param.grad, but gradient accumulation fusion "
                     "writes it straight into main_grad; add --no-gradient-accumulation-fusion")
    if getattr(args, "calculate_per_token_loss", False):
        found.append("--adama folds each micro-batch gradient as it is produced and cannot rescale it by the "
                     "token count afterwards; drop --calculate-per-token-loss")
    # adacc train has no --ckpt-format: its checkpoints are plain torch files.
    checkpoints = getattr(args, "save", None) or getattr(args, "load", None)
    if checkpoints and getattr(args, "ckpt_format", "torch") != "torch":
        found.append("--adama checkpoints its moments (each rank's shards with --use-distributed-optimizer) as plain "
                     "torch files; add --ckpt-format torch (Megatron's distributed checkpoint formats are not "
                     "implemented for AdamA)")
    return found


def preflight(args: Any) -> None:
    """AdamA's own checks of the flags (clipping, fp16, overlap modes), before the model is built."""
    try:
        require(FEATURE, "megatron_adacc.optim.megatron", "check_supported")(args)
    except ValueError as exc:
        if isinstance(exc, IntegrationError):
            raise
        raise IntegrationError(f"cannot run this command line:\n  - {exc}") from exc


def build_extensions(args: Any, config: Any) -> list:
    return require(FEATURE, "megatron_adacc.optim.extension", "build_extensions")(args, config)


FEATURE = Feature(
    name="adama", flag="--adama", dest="adama", off=False,
    add_args=add_args, build_extensions=build_extensions, problems=problems, preflight=preflight,
    conflicts={"resireduce": "--adama folds gradients into Adam's moments during backward and all-reduces the "
                             "moments, so there is no gradient left for --resireduce to compress; use one of them",
               "gact": "--gact-level probes gradients with extra backward passes, which --adama would fold into "
                       "Adam's moments as if they were training steps; use one of them"},
    hooks=frozenset({"wrap_model", "build_optimizer"}),
    flag_prefixes=("--adama",),
)
