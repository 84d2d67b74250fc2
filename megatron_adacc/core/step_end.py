"""Device values that features hand the host once per step, read together with what the host reads anyway.

Reading a device value on the host (``.item()``, ``bool(t)``) stops a GPU's launch queue until everything before
it has run. A feature that needs to know something the device found (a NaN/Inf flag of a saved activation, how
many outlier channels a codec met) therefore keeps the value on the device and registers a :class:`StepEndSource`
here; the host, at the end of each step, takes every source's values as one device vector (:meth:`StepEnd.take`),
reads it in the same transfer as its own per-step read (``adacc train``: the finite-and-carry-on flags;
Megatron-LM: the step's loss), and hands the numbers back (:meth:`StepEnd.settle`). A step thus costs the features
no host sync of their own.

A host that reads nothing else calls :meth:`StepEnd.settle` with no values: one read of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["STEP_END", "StepEnd", "StepEndSource"]


class StepEndSource(Protocol):
    """What a feature registers: its values of the step, and what to do with them once read."""

    def take(self) -> tuple[torch.Tensor, Any] | None:
        """This step's values as a 1-D integer device tensor, and what :meth:`settle` needs to make sense of
        them (None: nothing this step). Taking them starts the next step's collection."""

    def settle(self, taken: Any, values: list[int]) -> None:
        """The numbers read from the tensor :meth:`take` returned with ``taken``."""


class StepEnd:
    """The sources of this process and the values taken from them and not yet settled."""

    def __init__(self) -> None:
        self._sources: list[StepEndSource] = []
        self._taken: list[tuple[StepEndSource, Any, int]] | None = None
        self._vector: torch.Tensor | None = None

    def register(self, source: StepEndSource) -> StepEndSource:
        """Add ``source`` (once; registering it again does nothing)."""
        if not any(s is source for s in self._sources):
            self._sources.append(source)
        return source

    def take(self) -> torch.Tensor | None:
        """Every source's values of the step as one int64 device vector, without reading it (None: no values).
        The host reads it with its own values and passes the numbers to :meth:`settle`."""
        if self._taken is not None:
            return self._vector
        taken, parts = [], []
        for source in self._sources:
            got = source.take()
            if got is not None:
                values, token = got
                taken.append((source, token, values.numel()))
                parts.append(values.reshape(-1).to(torch.int64))
        self._taken = taken
        if parts:
            device = parts[0].device  # one device: a value elsewhere comes over without a stream sync
            self._vector = torch.cat([p.to(device, non_blocking=True) for p in parts])
        return self._vector

    def settle(self, values: Sequence[int | float] | None = None) -> None:
        """Hand the numbers of :meth:`take`'s vector back to their sources. Without ``values`` the vector is
        taken (if it was not) and read here: one host sync, for a host that reads nothing else."""
        if self._taken is None:
            self.take()
        taken, vector = self._taken or [], self._vector
        self._taken, self._vector = None, None
        if not taken:
            return
        numbers = [int(v) for v in (vector.tolist() if values is None else values)]
        if len(numbers) != sum(n for _, _, n in taken):
            raise ValueError(f"StepEnd.settle: {len(numbers)} values for a vector of "
                             f"{sum(n for _, _, n in taken)}")
        start = 0
        for source, token, n in taken:
            source.settle(token, numbers[start:start + n])
            start += n

    def discard(self) -> None:
        """Drop everything taken and not settled, and what the sources hold (a new run)."""
        self._taken, self._vector = None, None
        for source in self._sources:
            source.take()


#: The process's step end: every feature registers its sources here, and both hosts take and settle it.
STEP_END = StepEnd()
