"""The one protocol through which a feature (GACT, ResiReduce, Adacc evolution, ...) joins `adacc train`.

The training loop knows nothing about individual features: each ``--flag`` builds an extension from its own
package, and the loop calls the hooks below at fixed points. Hooks default to doing nothing, so an extension
implements only what it needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainingContext:
    """What the loop hands to every extension once the model and optimizer exist."""

    args: Any
    """The parsed `adacc train` arguments (see `megatron_adacc.arguments`)."""
    config: Any
    """The megatron-core ``TransformerConfig`` of the model."""
    model: list
    """The unwrapped model chunks (``GPTModel`` instances)."""
    ddp_model: list
    """The model chunks as trained: Megatron ``DistributedDataParallel`` wrappers (or the bare models)."""
    optimizer: Any
    """The Megatron optimizer (or AdamA's) stepping the model."""
    forward_backward: Callable[[], float] | None = None
    """Runs one extra micro-batch forward and backward on a held-out batch and returns its loss; gradients
    land where the real step puts them. Used by extensions that probe gradients (GACT's sensitivity)."""
    extras: dict = field(default_factory=dict)


class TrainingExtension:
    """Base class: override the hooks a feature needs."""

    name: str = "extension"

    def setup(self, ctx: TrainingContext) -> None:
        """Called once, after the model, DDP wrapper and optimizer are built and before the first step."""

    def microbatch_context(self) -> ContextManager:
        """Entered around every micro-batch's forward and backward (e.g. saved-tensor hooks)."""
        return contextlib.nullcontext()

    def on_step_begin(self, iteration: int) -> None:
        """Called before the first micro-batch of iteration ``iteration`` (1-based)."""

    def on_step_end(self, iteration: int, loss: float) -> None:
        """Called after the optimizer step of iteration ``iteration``."""

    def state_dict(self) -> dict:
        """Extra state saved with a checkpoint (``--save``) and given back on ``--load``."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def report(self) -> dict[str, Any]:
        """Figures printed in the final summary of `adacc train` and stored in its JSON output."""
        return {}
