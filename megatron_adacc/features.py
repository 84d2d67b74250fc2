"""The plugin registry: every feature megatron-adacc offers, one line each, in set-up order (outermost first).

Both hosts iterate this tuple and nothing else: ``adacc train`` (:mod:`megatron_adacc.training`) and the
Megatron-LM integration (:mod:`megatron_adacc.megatron_lm`). An entry is a
:class:`~megatron_adacc.core.features.Feature`; docs/ARCHITECTURE.md shows how to add one.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from megatron_adacc.core import features as _features
from megatron_adacc.core.features import Feature

#: One line per feature: the module that holds its ``FEATURE`` entry. (tests/architecture reads these names as
#: imports of this module.)
ENTRIES = (
    "megatron_adacc.adacc.feature",
    "megatron_adacc.comm.feature",
    "megatron_adacc.gact.feature",
    "megatron_adacc.optim.feature",
)
FEATURES: tuple[Feature, ...] = tuple(importlib.import_module(entry).FEATURE for entry in ENTRIES)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every feature's flags (and only those); safe on Megatron-LM's parser, whose flags none of them shadow."""
    for feature in FEATURES:
        feature.add_args(parser)
    return parser


def enabled(args: Any) -> list[Feature]:
    """The features ``args`` turns on, in set-up order."""
    return _features.enabled(FEATURES, args)


def flag_prefixes() -> tuple[str, ...]:
    """The prefixes of every flag the features add."""
    return tuple(prefix for feature in FEATURES for prefix in feature.flag_prefixes)
