"""GACT's bit allocator: the per-tensor bit widths training uses, between and after adaptations.

:mod:`~megatron_adacc.gact.allocation` holds the math (Problem (4) and its greedy solver); this module holds
the state around it: the sensitivities of the last probe, the tensor sizes seen, the allocation made from
them, and the answer to "how many bits for saved tensor ``l`` now?" that the saved-tensor hooks ask.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_adacc.gact.allocation import BIT_LEVELS, KEEP_BITS, allocate_bits, predicted_variance


class BitAllocator:
    """Per-tensor bits from sensitivities under an average-bits budget.

    Args:
        avg_bits: the budget, average bits per activation value (weighted by tensor size).
        levels: the bit widths to choose from (32 = keep the tensor uncompressed).
        adaptive: ``False`` gives every tensor :attr:`fixed_bits` and ignores allocations.
    """

    def __init__(self, avg_bits: float, levels: Sequence[int] = BIT_LEVELS, adaptive: bool = True):
        if not min(levels) <= avg_bits <= KEEP_BITS:
            raise ValueError(f"bits={avg_bits} is outside the bit levels {sorted(levels)}; try --gact-bits 4")
        self.levels = tuple(sorted(set(levels)))
        self.avg_bits = float(avg_bits)
        self.fixed_bits = max(b for b in self.levels if b <= avg_bits)
        """The largest level within the budget: what every tensor gets before (or without) adaptation."""
        self.adaptive = adaptive
        self.bits: dict[int, int] = {}
        self.sensitivity: dict[int, float] = {}
        self.dims: dict[int, int] = {}
        """Values per saved tensor ``l`` (``D_l``), as last seen by a pass or a probe."""
        self.predicted_variance: float | None = None
        """``sum_l c_l S(b_l)`` of the current allocation (Theorem 2), or None before the first."""

    def bits_for(self, tensor_id: int, numel: int) -> int:
        """Bits for saved tensor ``tensor_id`` of ``numel`` values in a training pass."""
        if not self.adaptive:
            return self.fixed_bits
        self.dims.setdefault(tensor_id, numel)
        if self.dims.get(tensor_id) == numel and tensor_id in self.bits:
            return self.bits[tensor_id]
        # Not seen by an adaptation yet, or the graph changed under the same id: its sensitivity is unknown,
        # so it gets the budget's own level rather than another tensor's allocation.
        return self.fixed_bits

    def allocate(self, sensitivity: Mapping[int, float]) -> dict[int, int]:
        """Choose bits for every tensor of ``sensitivity`` (whose sizes must be in :attr:`dims`)."""
        # A non-finite estimate means the tensor is too sensitive to measure: treat it as the most sensitive.
        finite = [c for c in sensitivity.values() if math.isfinite(c)]
        cap = max(finite) * 1e3 if finite and max(finite) > 0 else 1.0
        self.sensitivity = {t: (c if math.isfinite(c) else cap) for t, c in sensitivity.items()}
        ids = sorted(self.sensitivity)
        costs = [self.sensitivity[t] for t in ids]
        alloc = allocate_bits(costs, [self.dims[t] for t in ids], self.avg_bits, self.levels)
        self.bits = dict(zip(ids, alloc))
        self.predicted_variance = predicted_variance(costs, alloc)
        return dict(self.bits)

    def histogram(self) -> dict[int, int]:
        """Tensors per bit width of the current allocation, narrowest first."""
        hist: dict[int, int] = {}
        for b in self.bits.values():
            hist[b] = hist.get(b, 0) + 1
        return dict(sorted(hist.items()))

    def mean_bits(self) -> float | None:
        """Average bits per value of the current allocation, weighted by size (the budget's measure)."""
        if not self.bits:
            return None
        num = sum(self.bits[t] * self.dims[t] for t in self.bits)
        return num / sum(self.dims[t] for t in self.bits)

    def state_dict(self) -> dict[str, Any]:
        return {"bits": dict(self.bits), "sensitivity": dict(self.sensitivity), "dims": dict(self.dims)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # Keys come back as strings from a JSON checkpoint.
        self.bits = {int(k): int(v) for k, v in state["bits"].items()}
        self.sensitivity = {int(k): float(v) for k, v in state["sensitivity"].items()}
        self.dims = {int(k): int(v) for k, v in state["dims"].items()}
