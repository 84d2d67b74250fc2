"""Pareto-optimal single-layer policies (memory vs time), by dynamic programming over stored ops.

A layer policy is a sequence of stored ops (kept or compressed) separated by recompute segments, so the
DP state is "op j is stored with choice k": moving to the next stored op j' adds the segment j+1..j'-1
and the choice at j'. Dominated partial policies are pruned at every state, which is exact because both
memory and time are sums over the (segment, stored op) steps.

Each point has three costs: the bytes the layer stores, the bytes it re-materializes in its backward (the
transient of :mod:`megatron_adacc.adacc.policy.cost_model`) and the time. A point is dropped only when another is
no worse in all three, so the smallest feasible budget and every uniform optimum are on the front.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from megatron_adacc.adacc.policy.cost_model import Choice, Problem
from megatron_adacc.adacc.policy.ops import candidate_segments


@dataclass(frozen=True)
class ParetoPoint:
    memory_bytes: float
    """Bytes the layer stores for backward."""
    time_s: float
    picks: tuple[int, ...]
    recompute_bytes: float = 0.0
    """Bytes of the layer's recomputed ops (summed: see :meth:`Problem.layer_remat`)."""
    decompress_bytes: float = 0.0
    """Re-materialized bytes of the layer's largest compressed op (its copy and gradient)."""

    @property
    def remat_bytes(self) -> float:
        """Bytes the layer re-materializes in its backward."""
        return self.recompute_bytes + self.decompress_bytes


def _prune(points: list[ParetoPoint], cost) -> list[ParetoPoint]:
    """Keep the points no other point matches or beats in memory, time and ``cost(point)`` (ties: the first),
    sorted by increasing memory.

    Sorted by memory, a point can only be dominated by an earlier one that is no slower and no worse on
    ``cost``; the earlier kept points are summarized by their (time, cost) staircase, so each check is a
    binary search.
    """
    points.sort(key=lambda p: (p.memory_bytes, p.time_s, cost(p)))
    stair_t: list[float] = []  # increasing time ...
    stair_c: list[float] = []  # ... strictly decreasing cost
    out: list[ParetoPoint] = []
    for p in points:
        t, c = p.time_s, cost(p)
        i = bisect.bisect_right(stair_t, t)
        if i and stair_c[i - 1] <= c:  # the cheapest earlier point at least as fast is no costlier
            continue
        out.append(p)
        j = i
        while j < len(stair_t) and stair_c[j] >= c:  # staircase points p now covers
            j += 1
        stair_t[i:j] = [t]
        stair_c[i:j] = [c]
    return out


def _recompute_cost(p: ParetoPoint) -> float:
    return p.recompute_bytes


def _remat_cost(p: ParetoPoint) -> float:
    return p.remat_bytes


def pareto_front(problem: Problem, *, chain_aware: bool) -> list[ParetoPoint]:
    """Every single-layer policy not dominated in (memory, re-materialization, time), by increasing memory.

    A layer re-materializes the sum of its recomputed ops plus its largest compressed op (a max, which does
    not extend additively from a prefix). So the DP runs once per cap on the largest compressed op, offering
    only compress choices within the cap; inside one run prefixes compare on (memory, time, recomputed
    bytes), which is exact, and the union of the runs is pruned on the full re-materialization.
    """
    caps = sorted({c.remat_bytes for cs in problem.choices for c in cs if not c.is_recompute})
    points: list[ParetoPoint] = []
    for cap in caps:
        points.extend(_front_capped(problem, chain_aware, cap))
    if problem.runtime_overhead_s:
        # every policy but keep-all pays the runtime's fixed cost: a constant over them, so the DP's pruning
        # among them holds, and keep-all (the most memory) cannot dominate any of them
        points = [p if problem.is_stock(p.picks) else
                  ParetoPoint(p.memory_bytes, p.time_s + problem.runtime_overhead_s, p.picks, p.recompute_bytes,
                              p.decompress_bytes) for p in points]
    return _prune(points, _remat_cost)


def _front_capped(problem: Problem, chain_aware: bool, cap: float) -> list[ParetoPoint]:
    n = problem.num_ops
    rec = [next((k for k, c in enumerate(cs) if c.is_recompute), None) for cs in problem.choices]
    recomputable = [k is not None for k in rec]

    def segment_time(seg: range, before: Choice) -> float:
        if chain_aware:
            return problem.segment_cost(seg.start, seg.stop - 1, before)
        return sum(problem.choices[i][rec[i]].time_s for i in seg)

    # states[j][k]: Pareto set of prefixes 0..j that store op j with choice k
    states: list[dict[int, list[ParetoPoint]]] = [dict() for _ in range(n)]
    for k, c in enumerate(problem.choices[0]):
        if not c.is_recompute and c.remat_bytes <= cap:
            states[0][k] = [ParetoPoint(c.memory_bytes, c.time_s, (k,), 0.0, c.remat_bytes)]
    final: list[ParetoPoint] = []
    for j in range(n):
        for k, prefix in states[j].items():
            # the ops after j up to the next stored op nxt are recomputed
            for seg in candidate_segments(recomputable, j + 1):
                nxt = seg.stop
                seg_cost = segment_time(seg, problem.choices[j][k]) if seg else 0.0
                seg_picks = tuple(rec[i] for i in seg)
                seg_remat = sum(problem.choices[i][rec[i]].remat_bytes for i in seg)
                stash = (problem.segment_memory(seg.start, seg.stop - 1, problem.choices[j][k])
                         if chain_aware and seg else 0.0)
                if nxt == n:
                    final.extend(ParetoPoint(p.memory_bytes + stash, p.time_s + seg_cost, p.picks + seg_picks,
                                             p.recompute_bytes + seg_remat, p.decompress_bytes) for p in prefix)
                else:
                    for k2, c2 in enumerate(problem.choices[nxt]):
                        if c2.is_recompute or c2.remat_bytes > cap:
                            continue
                        bucket = states[nxt].setdefault(k2, [])
                        bucket.extend(ParetoPoint(p.memory_bytes + stash + c2.memory_bytes,
                                                  p.time_s + seg_cost + c2.time_s, p.picks + seg_picks + (k2,),
                                                  p.recompute_bytes + seg_remat,
                                                  max(p.decompress_bytes, c2.remat_bytes)) for p in prefix)
        if j + 1 < n:
            for k2 in states[j + 1]:
                states[j + 1][k2] = _prune(states[j + 1][k2], _recompute_cost)
    return _prune(final, _remat_cost)
