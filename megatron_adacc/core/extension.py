"""The one protocol through which a feature (Adacc, GACT, ResiReduce, AdamA, ...) joins a training run.

Both hosts, ``adacc train`` and Megatron-LM's training loop (:mod:`megatron_adacc.megatron_lm`), know nothing
about individual features: each enabled feature (:mod:`megatron_adacc.core.features`) builds its extensions,
and the host calls the hooks below at fixed points, in this order::

    wrap_model -> build_optimizer -> setup -> per step: on_step_begin, per micro-batch: microbatch_context,
    on_step_end -> state_dict / load_state_dict with checkpoints -> report

Hooks default to doing nothing (``wrap_model`` and ``build_optimizer`` to the host's own choice), so an
extension implements only what it needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
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


class TrainingExtension:
    """Base class: override the hooks a feature needs."""

    name: str = "extension"
    state_optional: bool = False
    """Whether a checkpoint may be resumed with this extension added or dropped: its state starts afresh when
    the checkpoint has none, and is not needed when the run has no such extension. True for extensions that
    change how activations are held, never what the model or optimizer hold (Adacc's policy and its
    evolution): a model pretrained stock can go on under Adacc, to fit a larger micro-batch."""

    def wrap_model(self, chunks: list, wrap: Callable[[list], list], ddp_config: Any = None) -> list:
        """The model chunks as they will be trained. ``wrap`` is the host's choice (Megatron's DDP, or the
        next extension's) and ``ddp_config`` the DDP configuration it uses; an extension that replaces it
        (AdamA, which must not have DDP's gradient buffer) returns its own wrappers. Called before
        :meth:`build_optimizer`, only for extensions of a feature that declares the ``wrap_model`` hook."""
        return wrap(chunks)

    def build_optimizer(self, chunks: list, build: Callable[[list], Any]) -> Any:
        """The optimizer for ``chunks`` (the wrapped chunks). ``build`` is the host's choice (Megatron's
        optimizer); AdamA returns its own. Only for extensions of a feature that declares this hook."""
        return build(chunks)

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
