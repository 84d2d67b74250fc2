"""Pareto-optimal single-layer policies (memory vs time), by dynamic programming over stored ops.

A layer policy is a sequence of stored ops (kept or compressed) separated by recompute segments, so the
DP state is "op j is stored with choice k": moving to the next stored op j' adds the segment j+1..j'-1
and the choice at j'. Dominated partial policies are pruned at every state, which is exact because both
memory and time are sums over the (segment, stored op) steps.

Each point has three costs: the bytes the layer stores, the bytes it re-materializes in its backward (the
transient of :mod:`megatron_adacc.policy.cost_model`) and the time. A point is dropped only when another is
no worse in all three, so the smallest feasible budget and every uniform optimum are on the front.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_adacc.policy.cost_model import Problem


@dataclass(frozen=True)
class ParetoPoint:
    memory_bytes: float
    """Bytes the layer stores for backward."""
    time_s: float
    picks: tuple[int, ...]
    remat_bytes: float = 0.0
    """Bytes the layer re-materializes in its backward."""


def _prune(points: list[ParetoPoint]) -> list[ParetoPoint]:
    """Keep the points no other point matches or beats in memory, re-materialization and time (ties: the
    first), sorted by increasing memory."""
    points.sort(key=lambda p: (p.memory_bytes, p.time_s, p.remat_bytes))
    out: list[ParetoPoint] = []
    best_time = float("inf")
    for p in points:
        if p.time_s < best_time:  # beats every point with less memory on time: not dominated
            out.append(p)
            best_time = p.time_s
        elif not any(q.time_s <= p.time_s and q.remat_bytes <= p.remat_bytes for q in out):
            out.append(p)
    return out


def pareto_front(problem: Problem, *, chain_aware: bool) -> list[ParetoPoint]:
    """Every single-layer policy not dominated in (memory, re-materialization, time), by increasing memory."""
    n = problem.num_ops
    point = ParetoPoint

    rec = [next((k for k, c in enumerate(cs) if c.is_recompute), None) for cs in problem.choices]

    def segment(a: int, b: int, before_k: int, before_op: int) -> float:
        if chain_aware:
            return problem.segment_cost(a, b, problem.choices[before_op][before_k])
        return sum(problem.choices[i][rec[i]].time_s for i in range(a, b + 1))

    # states[j][k]: Pareto set of prefixes 0..j that store op j with choice k
    states: list[dict[int, list[ParetoPoint]]] = [dict() for _ in range(n)]
    for k, c in enumerate(problem.choices[0]):
        states[0][k] = [point(c.memory_bytes, c.time_s, (k,), c.remat_bytes)]
    final: list[ParetoPoint] = []
    for j in range(n):
        for k, prefix in states[j].items():
            # the ops after j up to the next stored op are recomputed; stop at the first op that cannot be
            for nxt in range(j + 1, n + 1):
                seg = (j + 1, nxt - 1)
                seg_cost = segment(seg[0], seg[1], k, j) if nxt - 1 >= j + 1 else 0.0
                seg_picks = tuple(rec[i] for i in range(j + 1, nxt))
                seg_remat = sum(problem.choices[i][rec[i]].remat_bytes for i in range(j + 1, nxt))
                stash = (problem.segment_memory(j + 1, nxt - 1, problem.choices[j][k])
                         if chain_aware and nxt > j + 1 else 0.0)
                if nxt == n:
                    final.extend(point(p.memory_bytes + stash, p.time_s + seg_cost, p.picks + seg_picks,
                                       p.remat_bytes + seg_remat) for p in prefix)
                else:
                    for k2, c2 in enumerate(problem.choices[nxt]):
                        if c2.is_recompute:
                            continue
                        bucket = states[nxt].setdefault(k2, [])
                        bucket.extend(point(p.memory_bytes + stash + c2.memory_bytes,
                                            p.time_s + seg_cost + c2.time_s, p.picks + seg_picks + (k2,),
                                            p.remat_bytes + seg_remat + c2.remat_bytes) for p in prefix)
                if nxt < n and rec[nxt] is None:
                    break
        if j + 1 < n:
            for k2 in states[j + 1]:
                states[j + 1][k2] = _prune(states[j + 1][k2])
    return _prune(final)
