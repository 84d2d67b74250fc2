"""GACT as a training extension (``adacc train --gact-level ...``), and the level effects it owns.

The :class:`~megatron_adacc.gact.controller.Controller` compresses saved tensors in any torch model. What
CB1 and CB2 add on top is a change to the megatron-core model itself (full recompute, memory-efficient
attention, :mod:`~megatron_adacc.gact.megatron`); :func:`apply_level_effects` decides which to make, and the
extension makes them before it builds the controller.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from megatron_adacc.core.extension import TrainingContext, TrainingExtension
from megatron_adacc.gact.controller import Controller
from megatron_adacc.gact.levels import Level
from megatron_adacc.gact.megatron import enable_full_recompute, enable_memory_efficient_attention


def apply_level_effects(level: str | Level, model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[str]:
    """Make the model changes ``level`` adds to compression; returns one report note per change.

    CB1: megatron-core full recompute (its saved layer inputs are then compressed); CB2: CB1 + memory-efficient
    attention; other levels: nothing. Raises ``ValueError`` naming what prevents a change (no megatron
    ``TransformerConfig``, selective recompute, attention dropout on CPU, ...). Call it before building a
    ``Controller`` at CB1/CB2 outside ``adacc train``; :class:`GactExtension` calls it itself."""
    level = Level.parse(level)
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    notes = []
    if level.recomputes:
        notes.append(enable_full_recompute(modules))
    if level.efficient_attention:
        notes.append(enable_memory_efficient_attention(modules))
    return notes


class GactExtension(TrainingExtension):
    """``adacc train --gact-level ...``: compress every micro-batch's saved tensors, adapt bits."""

    name = "gact"

    def __init__(self, level: str | Level = "L1", bits: float = 4.0, adapt_interval: int = 1000,
                 group_size: int = 256, adaptive: bool = True, seed: int = 0, **controller_kwargs: Any):
        self.level = Level.parse(level)
        self.kwargs = dict(level=self.level, bits=bits, adapt_interval=adapt_interval, group_size=group_size,
                           adaptive=adaptive, seed=seed, **controller_kwargs)
        self.controller: Controller | None = None
        self._forward_backward = None
        self._pending_state: dict | None = None

    def setup(self, ctx: TrainingContext) -> None:
        notes = apply_level_effects(self.level, ctx.model)  # first: the controller checks recompute is on
        self.controller = Controller(ctx.model, **self.kwargs)
        self.controller.notes.extend(notes)
        if self._pending_state:
            self.controller.load_state_dict(self._pending_state)
        self._forward_backward = ctx.forward_backward
        a = ctx.args
        if a is not None and getattr(a, "global_batch_size", None) and getattr(a, "micro_batch_size", None):
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            self.controller.microbatches_per_step = max(1, a.global_batch_size // (a.micro_batch_size * world))
        if self.level.compresses and self.controller.adaptive and ctx.forward_backward is None:
            raise RuntimeError("GACT adaptive bits need TrainingContext.forward_backward to probe gradients")

    def microbatch_context(self):
        assert self.controller is not None, "GactExtension.setup() was not called"
        return self.controller.hooks()

    def on_step_begin(self, iteration: int) -> None:
        ctl = self.controller
        ctl.iteration = iteration - 1
        ctl.maybe_adapt(self._forward_backward)

    def on_step_end(self, iteration: int, loss: float) -> None:
        self.controller.observe_gradients()
        self.controller.iteration = iteration

    def state_dict(self) -> dict:
        return self.controller.state_dict() if self.controller is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.controller is None:
            self._pending_state = state
        elif state:
            self.controller.load_state_dict(state)

    def report(self) -> dict[str, Any]:
        return self.controller.report() if self.controller is not None else {"gact_level": self.level.value}


def build_extension(args: Any) -> GactExtension:
    """Extension for ``adacc train`` arguments (``--gact-level/-bits/-adapt-interval/-group-size``).

    ``args.gact_adaptive = False`` (no flag yet; the benchmark sets it) gives fixed bits."""
    bits = float(getattr(args, "gact_bits", 4.0))
    if not math.isfinite(bits):
        raise ValueError(f"--gact-bits must be finite, got {bits}")
    return GactExtension(
        level=getattr(args, "gact_level", "L0"),
        bits=bits,
        adapt_interval=int(getattr(args, "gact_adapt_interval", 1000)),
        group_size=int(getattr(args, "gact_group_size", 256)),
        adaptive=bool(getattr(args, "gact_adaptive", True)),
        seed=int(getattr(args, "seed", 0) or 0),
    )
