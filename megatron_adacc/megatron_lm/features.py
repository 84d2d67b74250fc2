"""Which features a Megatron-LM command line turns on, and what this host adds to their checks.

The features and their refusals are the registry's (:mod:`megatron_adacc.features`); this module adds only
what is particular to Megatron-LM: a Namespace that lost our flags (``--yaml-cfg``) and in-process restarts.
Everything here reads the parsed ``args`` only: it runs before Megatron initializes anything, so a bad
combination fails in the first second instead of after model construction.
"""

from __future__ import annotations

import sys
from typing import Any

from megatron_adacc import features
from megatron_adacc.core import features as core_features
from megatron_adacc.core.errors import FeatureUnavailable, IntegrationError
from megatron_adacc.core.features import Feature

FEATURES = features.FEATURES

__all__ = ["FEATURES", "Feature", "FeatureUnavailable", "IntegrationError", "check_combination", "enabled_features",
           "idle_feature_flags"]


def enabled_features(args: Any) -> list[Feature]:
    """The features ``args`` turns on, in the order they are set up."""
    _require_our_args(args)
    return features.enabled(args)


def _require_our_args(args: Any, argv: list[str] | None = None) -> None:
    """Refuse a Namespace that lost our flags although the command line had them.

    Megatron-LM's ``--yaml-cfg`` path replaces the parsed Namespace by the YAML file's contents, dropping
    every extra flag; without this check ``--adacc-policy auto`` would silently train the stock model.
    """
    if hasattr(args, FEATURES[0].dest):
        return
    argv = sys.argv[1:] if argv is None else argv
    given = [a.split("=")[0] for a in argv if a.startswith(features.flag_prefixes())]
    if given:
        raise IntegrationError(
            f"{', '.join(given)} were given but the parsed arguments do not contain them: Megatron-LM's "
            "--yaml-cfg replaces the command line by the YAML file. Put the megatron-adacc flags on the "
            "command line without --yaml-cfg."
        )


def host_problems(args: Any) -> list[str]:
    """What no feature can run with in Megatron-LM."""
    if getattr(args, "inprocess_restart", False):
        return ["megatron-adacc attaches to the model once per process; --inprocess-restart rebuilds it in the "
                "same process. Drop --inprocess-restart"]
    return []


def idle_feature_flags(args: Any, argv: list[str] | None = None) -> list[str]:
    """The flags on the command line (``argv``, else ``sys.argv[1:]``, what Megatron-LM parsed) of features
    that ``args`` leaves off, one line each, as ``adacc train`` refuses them: a user who wrote ``--gact-bits 2``
    without ``--gact-level`` believes GACT is on."""
    return core_features.idle_flags(FEATURES, args, sys.argv[1:] if argv is None else argv)


def check_combination(args: Any, enabled: list[Feature], argv: list[str] | None = None) -> None:
    """Raise :class:`IntegrationError` naming the flag to change when ``enabled`` cannot run with ``args``, or
    when ``argv`` (default ``sys.argv[1:]``) configures a feature that is off. The host's own problems only
    matter when a feature runs: with none, the stock run is Megatron-LM's business."""
    extra = (host_problems(args) if enabled else []) + idle_feature_flags(args, argv)
    core_features.check(enabled, args, extra=extra)
