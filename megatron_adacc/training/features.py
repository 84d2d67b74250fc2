"""Turn feature flags into training extensions. Each feature's package is imported only when its flag is on,
so `adacc train` with every flag off runs stock megatron-core and nothing else."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_adacc.core.extension import TrainingExtension


def check_flag_combinations(args: SimpleNamespace) -> None:
    """Combinations that cannot mean anything sensible, refused before any work is done."""
    adacc_on = args.adacc_policy != "none"
    if adacc_on and args.recompute_granularity:
        raise SystemExit(
            f"--adacc-policy {args.adacc_policy} decides recomputation itself; drop "
            f"--recompute-granularity {args.recompute_granularity} (or use --adacc-policy none)."
        )
    if adacc_on and args.gact_level != "L0":
        raise SystemExit(
            "--adacc-policy and --gact-level both compress activations with saved-tensor hooks and cannot be "
            "stacked. Use --adacc-codec gact to let Adacc's compressed tensors use GACT's adaptive bits."
        )
    if args.adama and args.resireduce != "off":
        raise SystemExit(
            "--adama all-reduces Adam's moments once per mini-batch instead of gradients, so there is no "
            "gradient communication for --resireduce to compress. Use one of the two."
        )


def build_extensions(args: SimpleNamespace, config) -> list[TrainingExtension]:
    """The extensions the flags ask for, in the order their hooks should nest (outermost first)."""
    extensions: list[TrainingExtension] = []
    if args.adacc_policy != "none":
        from megatron_adacc.adacc.integration import build_extension as adacc_extension
        from megatron_adacc.adacc.integration.evolution import build_extension as evolution_extension
        from megatron_adacc.adacc.policy import Policy

        adacc = adacc_extension(args, config)
        extensions.append(adacc)
        # Only a solved policy (auto) carries the profile and budget that evolution re-solves against.
        evolution = evolution_extension(args, config, adacc.policy) if isinstance(adacc.policy, Policy) else None
        if evolution is not None:
            extensions.append(evolution)
    if args.gact_level != "L0":
        from megatron_adacc.gact import build_extension as gact_extension

        extensions.append(gact_extension(args))
    if args.resireduce != "off":
        from megatron_adacc.comm import build_extension as comm_extension

        extensions.append(comm_extension(args))
    return extensions
