"""Bit allocation for GACT (section 4): minimise the predicted gradient variance under a bits budget.

Theorem 2 of the paper bounds the compression variance by ``sum_l c_l * S(b_l)`` with
``S(b) = (2**b - 1)**-2`` for the stochastic-rounding quantizer, ``c_l`` the sensitivity of tensor ``l``
and ``b_l`` its bits per element. Problem (4) picks ``b_l`` from a small set of levels to minimise that
sum subject to ``sum_l b_l * D_l <= avg_bits * sum_l D_l`` (``D_l`` = number of elements).

The solver is the greedy algorithm the paper cites (ActNN): start every tensor at the highest level and
repeatedly lower the tensor whose next step down costs the least variance per bit saved, until the budget
holds. Because ``S`` is convex over the levels, the per-step ratios of one tensor increase as its bits go
down, so every state the greedy passes through minimises ``V + lambda * bits`` for some ``lambda`` (a
Lagrangian point). Such a state is *exactly optimal among all schemes that use no more bits than it does*
(the property the tests check against brute force). Against the budget itself the greedy can leave slack
(a knapsack effect); a final pass spends that slack on the steps back up that remove the most variance
per bit, which never makes the result worse.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from megatron_adacc.gact.levels import BIT_LEVELS, KEEP_BITS

__all__ = ["BIT_LEVELS", "KEEP_BITS", "allocate_bits", "predicted_variance", "variance_factor"]


def variance_factor(bits: int) -> float:
    """``S(b) = (2**b - 1)**-2``; 0 for an uncompressed (32-bit) tensor, which adds no variance."""
    if bits >= KEEP_BITS:
        return 0.0
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    return float(2**bits - 1) ** -2


def predicted_variance(sensitivities: Sequence[float], bits: Sequence[int]) -> float:
    """``sum_l c_l S(b_l)``: the compression variance Theorem 2 predicts for a bit scheme."""
    if len(sensitivities) != len(bits):
        raise ValueError(f"{len(sensitivities)} sensitivities but {len(bits)} bit widths")
    return float(sum(c * variance_factor(b) for c, b in zip(sensitivities, bits)))


def total_bits(bits: Sequence[int], dims: Sequence[int]) -> int:
    return int(sum(b * d for b, d in zip(bits, dims)))


def _check(sensitivities: Sequence[float], dims: Sequence[int], levels: Sequence[int]) -> list[int]:
    if len(sensitivities) != len(dims):
        raise ValueError(f"{len(sensitivities)} sensitivities but {len(dims)} tensor sizes")
    if any(d <= 0 for d in dims):
        raise ValueError("every tensor size (dims) must be positive")
    if any(not math.isfinite(c) or c < 0 for c in sensitivities):
        raise ValueError("sensitivities must be finite and >= 0 (clip NaN/inf estimates before allocating)")
    lv = sorted({int(b) for b in levels})
    if not lv or lv[0] < 1:
        raise ValueError(f"bit levels must be >= 1, got {list(levels)}")
    return lv


def allocate_bits(
    sensitivities: Sequence[float],
    dims: Sequence[int],
    avg_bits: float,
    levels: Sequence[int] = BIT_LEVELS,
    fill_slack: bool = True,
) -> list[int]:
    """Choose ``b_l`` in ``levels`` minimising ``sum c_l S(b_l)`` s.t. ``sum b_l D_l <= avg_bits * sum D_l``.

    ``O(L log L)`` for a fixed number of levels. Raises if even the lowest level breaks the budget.
    """
    lv = _check(sensitivities, dims, levels)
    n = len(dims)
    if n == 0:
        return []
    budget = avg_bits * sum(dims)
    if lv[0] * sum(dims) > budget + 1e-9:
        raise ValueError(
            f"average-bits budget {avg_bits} is below the lowest bit level {lv[0]}; raise --gact-bits"
        )
    idx = [len(lv) - 1] * n  # index into lv of each tensor's current level
    used = lv[-1] * sum(dims)

    def down_ratio(i: int) -> float:
        """Variance added per bit saved by lowering tensor i one level."""
        hi, lo = lv[idx[i]], lv[idx[i] - 1]
        return sensitivities[i] * (variance_factor(lo) - variance_factor(hi)) / (dims[i] * (hi - lo))

    heap = [(down_ratio(i), i) for i in range(n) if idx[i] > 0]
    heapq.heapify(heap)
    while used > budget + 1e-9 and heap:
        _, i = heapq.heappop(heap)
        used -= (lv[idx[i]] - lv[idx[i] - 1]) * dims[i]
        idx[i] -= 1
        if idx[i] > 0:
            heapq.heappush(heap, (down_ratio(i), i))

    if fill_slack:
        # Spend leftover bits on single steps back up, most variance removed per bit first.
        while True:
            best, best_i = 0.0, -1
            for i in range(n):
                if idx[i] + 1 >= len(lv):
                    continue
                cost = (lv[idx[i] + 1] - lv[idx[i]]) * dims[i]
                if used + cost > budget + 1e-9:
                    continue
                gain = sensitivities[i] * (variance_factor(lv[idx[i]]) - variance_factor(lv[idx[i] + 1]))
                if gain / cost > best:
                    best, best_i = gain / cost, i
            if best_i < 0:
                break
            used += (lv[idx[best_i] + 1] - lv[idx[best_i]]) * dims[best_i]
            idx[best_i] += 1
    return [lv[k] for k in idx]
