"""How many channels outlier-separated INT4 stores exactly at each place of the model, learned without a host sync.

The codec's exact selection (``int4_outlier``, Adacc eq. 1) stores as many channels as the data has outliers, so
the host must read that number before it allocates: a sync at every compressed tensor on a GPU. The runtime
instead gives the codec a capacity, and the codec keeps the channels of largest Z-score up to it and counts the
outliers on the device (:class:`~megatron_adacc.codecs.int4.Int4OutlierCodec`). The capacity of a place (layer,
op, output or internal tensor, shape) is the largest count it had in the previous step: :data:`CAPACITIES` is a
:class:`~megatron_adacc.core.step_end.StepEndSource`, so the host reads the counts with its own per-step read.
In the first step a place is met, its tensors are compressed exactly (those reads size it). A caller without a
host that settles :data:`~megatron_adacc.core.step_end.STEP_END` once a step keeps that exact selection.

While the count does not grow from one step to the next, every outlier is stored exactly, as with the exact
selection, and the other channels of the capacity too (they decode exactly: never less accurate). A step whose
count grows quantizes its smallest outliers with the dense part, and the next step's capacity holds them. The
capacities are part of the Adacc extension's checkpoint state, so a resumed run compresses as a straight one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from megatron_adacc.core.step_end import STEP_END

__all__ = ["CAPACITIES", "OutlierCapacities"]


class OutlierCapacities:
    """The capacity of every place met so far, and the counts of the step under way (on the device)."""

    def __init__(self) -> None:
        self.capacity: dict[Hashable, int] = {}
        self._counts: dict[Hashable, torch.Tensor] = {}
        self._exact: dict[Hashable, int] = {}  # places met this step for the first time: their largest count

    def compress(self, codec: Any, t: torch.Tensor, place: Hashable) -> Any:
        """``codec.compress(t)`` at ``place``'s capacity (exactly, with one read, in the step it is first met:
        a place may see several tensors in a step, q, k and v of one op)."""
        capacity = self.capacity.get(place)
        if capacity is None:
            packed = codec.compress(t)
            self._exact[place] = max(self._exact.get(place, 0), packed.tensors["index"].numel())
            return packed
        packed = codec.compress(t, capacity=capacity)
        count = packed.found["outlier_channels"]
        seen = self._counts.get(place)
        self._counts[place] = count if seen is None else torch.maximum(seen, count)
        return packed

    # -- a StepEndSource
    def take(self) -> tuple[torch.Tensor, Any] | None:
        """The largest count of each place this step (see :class:`~megatron_adacc.core.step_end.StepEndSource`);
        the places met for the first time have theirs already, read by the exact selection."""
        self.capacity.update(self._exact)
        self._exact = {}
        if not self._counts:
            return None
        places, counts = list(self._counts), list(self._counts.values())
        self._counts = {}
        return torch.stack(counts), places

    def settle(self, taken: Any, values: list[int]) -> None:
        """Each place's count becomes its capacity for the next step."""
        for place, count in zip(taken, values):
            self.capacity[place] = count

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The capacities, as plain lists (a checkpoint loads with ``weights_only``)."""
        return {"capacity": [[list(_plain(place)), n] for place, n in self.capacity.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; counts of a step under way are dropped."""
        self.capacity = {_place(place): int(n) for place, n in state.get("capacity", [])}
        self._counts, self._exact = {}, {}

    def clear(self) -> None:
        """Forget every place (a new model)."""
        self.capacity.clear()
        self._counts.clear()
        self._exact.clear()


def _plain(place: Hashable) -> tuple:
    return tuple(list(p) if isinstance(p, tuple) else p for p in place)


def _place(items: list) -> tuple:
    return tuple(tuple(p) if isinstance(p, list) else p for p in items)


#: The process's capacities: the runtime compresses through it, the hosts settle it once per step.
CAPACITIES = STEP_END.register(OutlierCapacities())
