"""What a feature is, for the hosts: the shape of one entry of the plugin registry (:mod:`megatron_adacc.features`).

A feature is turned on by one flag. It adds its own flags to either host's parser, says which command lines it
cannot run with (one line each, naming the fix), builds the training extensions that do its work
(:class:`~megatron_adacc.core.extension.TrainingExtension`) and declares which extra host hooks those
extensions use. The hosts (``adacc train`` and the Megatron-LM integration) only iterate these entries.

Everything a feature's entry does at import time must be cheap: the entry is imported for every run, to add
flags, while the feature's own modules are imported only when its flag is on.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megatron_adacc.core.errors import FeatureUnavailable, IntegrationError

#: Host hooks a feature may declare beyond the ones every host always calls. A host installs the (Megatron-LM)
#: wrappers for these only when an enabled feature asks, so runs without such a feature stay untouched.
OPTIONAL_HOOKS = frozenset({"wrap_model", "build_optimizer"})


def _no_problems(args: Any) -> list[str]:
    return []


def _nothing(args: Any) -> None:
    return None


@dataclass(frozen=True)
class Feature:
    """One user-visible feature of the plugin."""

    name: str
    """Short name, used in reports and in other features' :attr:`conflicts` (``"adacc"``)."""
    flag: str
    """The flag that turns the feature on (``"--adacc-policy"``)."""
    dest: str
    """``argparse`` destination of :attr:`flag` (``"adacc_policy"``)."""
    off: Any
    """The value of :attr:`flag` that means "off" (``"none"``); any other value turns the feature on."""
    add_args: Callable[[argparse.ArgumentParser], Any]
    """Adds the feature's flags to a parser (Megatron-LM's or ``adacc train``'s); must not clash with
    Megatron-LM's own flags."""
    build_extensions: Callable[[Any, Any], list]
    """``(args, config) -> [TrainingExtension, ...]``, outermost first; called once the model's
    ``TransformerConfig`` exists. Imports the feature's modules; nothing else does before."""
    problems: Callable[[Any], list[str]] = _no_problems
    """``args -> [why, ...]``: the flags of the command line this feature cannot run with, one line each,
    naming the flag to change. Reads the parsed arguments only, so it runs before anything is built; an
    attribute a host does not have reads as that host's fixed behaviour (``adacc train`` has no
    ``--transformer-impl`` and always builds the local layer)."""
    conflicts: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Other features (by :attr:`name`) that cannot run together with this one, each with the reason and the
    fix. Stated by one of the two features only."""
    preflight: Callable[[Any], None] = _nothing
    """Fails early, before Megatron builds anything, on what only this feature can check (a policy file that
    does not exist, a module that cannot be imported)."""
    hooks: frozenset[str] = frozenset()
    """Optional host hooks (:data:`OPTIONAL_HOOKS`) the feature's extensions implement."""
    flag_prefixes: tuple[str, ...] = ()
    """Every flag the feature adds starts with one of these (used to notice flags that a host dropped)."""

    def __post_init__(self) -> None:
        unknown = set(self.hooks) - OPTIONAL_HOOKS
        if unknown:
            raise ValueError(f"feature {self.name}: unknown hooks {sorted(unknown)}; known: {sorted(OPTIONAL_HOOKS)}")

    def is_enabled(self, args: Any) -> bool:
        return getattr(args, self.dest, self.off) != self.off


def enabled(features: Iterable[Feature], args: Any) -> list[Feature]:
    """The entries of ``features`` that ``args`` turns on, in registry order."""
    return [f for f in features if f.is_enabled(args)]


def conflict(a: Feature, b: Feature) -> str | None:
    """Why ``a`` and ``b`` cannot run together (whichever of the two states it), or None when they can: the one
    fact both the hosts' refusal (:func:`problems`) and the documented pair table (:func:`pairs`) read."""
    return a.conflicts.get(b.name) or b.conflicts.get(a.name)


@dataclass(frozen=True)
class Pair:
    """Two features of a registry, and whether they run together."""

    first: Feature
    second: Feature
    refusal: str | None
    """The reason (and fix) the hosts refuse the pair with before building anything; None: it trains."""


def pairs(features: Sequence[Feature]) -> list[Pair]:
    """Every two of ``features``, in registry order, with its :func:`conflict`. Refuses a registry whose
    conflicts name a feature it does not have, or state one pair twice (two reasons that could drift)."""
    names = [f.name for f in features]
    for f in features:
        unknown = sorted(set(f.conflicts) - set(names))
        if unknown:
            raise ValueError(f"feature {f.name}: conflicts name {unknown}, which are not features ({names})")
        twice = sorted(other for other in f.conflicts
                       if f.name in features[names.index(other)].conflicts)
        if twice:
            raise ValueError(f"features {f.name} and {twice[0]} both state their conflict; keep one of the two")
    return [Pair(a, b, conflict(a, b)) for i, a in enumerate(features) for b in features[i + 1:]]


def problems(features: Iterable[Feature], args: Any) -> list[str]:
    """Every reason the enabled ``features`` cannot run with ``args``: pairwise conflicts, then each feature's
    own problems."""
    on = list(features)
    found = [why for i, a in enumerate(on) for b in on[i + 1:] if (why := conflict(a, b))]
    for f in on:
        found.extend(f.problems(args))
    return found


def idle_flags(features: Iterable[Feature], args: Any, argv: Iterable[str]) -> list[str]:
    """The flags on the command line ``argv`` of features that ``args`` leaves off, one line each: they would
    do nothing, and a user who wrote ``--gact-bits 2`` without ``--gact-level`` believes GACT is on."""
    given = [a.split("=")[0] for a in argv if a.startswith("--")]
    found = []
    for f in features:
        if f.is_enabled(args):
            continue
        idle = [flag for flag in given if flag != f.flag and flag.startswith(f.flag_prefixes)]
        if idle:
            found.append(f"{', '.join(dict.fromkeys(idle))} configure{'s' if len(idle) == 1 else ''} {f.name}, "
                         f"which is off: turn it on with {f.flag}, or drop {'it' if len(idle) == 1 else 'them'}")
    return found


def check(features: Iterable[Feature], args: Any, extra: Iterable[str] = ()) -> None:
    """Raise :class:`IntegrationError` listing every problem (``extra``: the host's own) at once."""
    found = [*extra, *problems(features, args)]
    if found:
        raise IntegrationError("cannot run this command line:\n  - " + "\n  - ".join(found))


def needs_hook(features: Iterable[Feature], hook: str) -> bool:
    """Whether any of ``features`` declares ``hook``."""
    return any(hook in f.hooks for f in features)


def build_extensions(features: Iterable[Feature], args: Any, config: Any) -> list:
    """The extensions of the enabled ``features``, outermost first."""
    return [ext for f in features for ext in f.build_extensions(args, config)]


def wrap_model(extensions: Iterable[Any], chunks: list, wrap: Callable[[list], list], ddp_config: Any = None) -> list:
    """``wrap`` passed through every extension's ``wrap_model``: the first extension has the last word."""
    for ext in reversed(list(extensions)):
        wrap = _chain(lambda c, inner, hook=ext.wrap_model: hook(c, inner, ddp_config), wrap)
    return wrap(chunks)


def build_optimizer(extensions: Iterable[Any], chunks: list, build: Callable[[list], Any]) -> Any:
    """``build`` passed through every extension's ``build_optimizer``: the first extension has the last word."""
    for ext in reversed(list(extensions)):
        build = _chain(ext.build_optimizer, build)
    return build(chunks)


def _chain(hook: Callable[[list, Callable], Any], inner: Callable[[list], Any]) -> Callable[[list], Any]:
    return lambda chunks: hook(chunks, inner)


def require(feature: Feature, module: str, attr: str) -> Any:
    """``module.attr``, imported now that ``feature``'s flag is on, or :class:`FeatureUnavailable` naming the
    flag and the fix (a broken installation should not look like a bug of the training run)."""
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise FeatureUnavailable(
            f"{feature.flag} needs {module}.{attr}, which this installation of megatron-adacc cannot provide "
            f"({type(exc).__name__}: {exc}). Reinstall megatron-adacc (`pip install -e .` from the "
            f"repository, with its compiled extension), or run without {feature.flag}."
        ) from exc


def saved_tensor_hook_problems(flag: str, args: Any) -> list[str]:
    """Megatron features that cannot run with a feature (``flag``) owning the saved-tensor hooks."""
    found = []
    if getattr(args, "fine_grained_activation_offloading", False):
        found.append(f"{flag} cannot run with --fine-grained-activation-offloading (both own the saved-tensor "
                     "hooks); drop --fine-grained-activation-offloading")
    if getattr(args, "cuda_graph_impl", "none") not in (None, "none"):
        found.append(f"{flag} cannot run inside CUDA graphs; use --cuda-graph-impl none")
    if getattr(args, "fp8", None) is not None or getattr(args, "fp4", None) is not None:
        found.append(f"{flag} compresses 16/32-bit activations; drop --fp8-format / --fp4-format")
    return found
