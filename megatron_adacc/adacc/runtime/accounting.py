"""Where the runtime files what each layer's forward left held for backward (see ``LayerMemory``).

The checkpoint function records one entry per layer forward; ``memory_report()`` (in
:mod:`megatron_adacc.adacc.runtime.memory`) reads the latest entry of each layer. Recording is a handful of
dictionary look-ups per saved tensor and is on by default; ``set_enabled(False)`` turns it off.
"""

from __future__ import annotations

from typing import Any

_ENABLED = True
_LATEST: dict[int, Any] = {}
_SIZES: dict[int, Any] = {}
# The policy the layers run under (a Policy, or a preset name until the first forward sizes it), set by
# whoever installs it (megatron_adacc.adacc.integration), so that reports need no import of the installer.
_POLICY: Any = None


def is_enabled() -> bool:
    return _ENABLED


def set_enabled(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = bool(enabled)


def record(entry: Any) -> None:
    """File ``entry`` (a ``LayerMemory``) as the latest measurement of its layer."""
    _LATEST[entry.layer] = entry


def latest() -> dict[int, Any]:
    """``{layer index: LayerMemory}`` of the most recent forward of each layer."""
    return dict(sorted(_LATEST.items()))


def record_sizes(layer: int, sizes: Any) -> None:
    """File the profiled per-op sizes (``LayerSizes``) of layer ``layer`` (for the predicted bytes)."""
    _SIZES[layer] = sizes


def sizes() -> dict[int, Any]:
    return dict(sorted(_SIZES.items()))


def set_policy(policy: Any) -> None:
    """Record the policy the layers now run under (None: no policy installed)."""
    global _POLICY
    _POLICY = policy


def policy() -> Any:
    """The policy the layers run under, or None."""
    return _POLICY


def clear() -> None:
    _LATEST.clear()
    _SIZES.clear()
