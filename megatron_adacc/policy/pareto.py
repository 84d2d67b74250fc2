"""Pareto-optimal single-layer policies (memory vs time), by dynamic programming over stored ops.

A layer policy is a sequence of stored ops (kept or compressed) separated by recompute segments, so the
DP state is "op j is stored with choice k": moving to the next stored op j' adds the segment j+1..j'-1
and the choice at j'. Dominated partial policies are pruned at every state, which is exact because both
memory and time are sums over the (segment, stored op) steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_adacc.policy.cost_model import Problem


@dataclass(frozen=True)
class ParetoPoint:
    memory_bytes: float
    time_s: float
    picks: tuple[int, ...]


def _prune(points: list[ParetoPoint]) -> list[ParetoPoint]:
    """Keep the points no other point beats in both memory and time (ties: the first)."""
    points.sort(key=lambda p: (p.memory_bytes, p.time_s))
    out: list[ParetoPoint] = []
    best = float("inf")
    for p in points:
        if p.time_s < best:
            out.append(p)
            best = p.time_s
    return out


def pareto_front(problem: Problem, *, chain_aware: bool) -> list[ParetoPoint]:
    """Every single-layer policy not dominated in (memory, time), sorted by increasing memory."""
    n = problem.num_ops
    rec = [next((k for k, c in enumerate(cs) if c.is_recompute), None) for cs in problem.choices]

    def segment(a: int, b: int, before_k: int, before_op: int) -> float:
        if chain_aware:
            return problem.segment_cost(a, b, problem.choices[before_op][before_k])
        return sum(problem.choices[i][rec[i]].time_s for i in range(a, b + 1))

    # states[j][k]: Pareto set of prefixes 0..j that store op j with choice k
    states: list[dict[int, list[ParetoPoint]]] = [dict() for _ in range(n)]
    for k, c in enumerate(problem.choices[0]):
        states[0][k] = [ParetoPoint(c.memory_bytes, c.time_s, (k,))]
    final: list[ParetoPoint] = []
    for j in range(n):
        for k, prefix in states[j].items():
            # the ops after j up to the next stored op are recomputed; stop at the first op that cannot be
            for nxt in range(j + 1, n + 1):
                seg = (j + 1, nxt - 1)
                seg_cost = segment(seg[0], seg[1], k, j) if nxt - 1 >= j + 1 else 0.0
                seg_picks = tuple(rec[i] for i in range(j + 1, nxt))
                stash = (problem.segment_memory(j + 1, nxt - 1, problem.choices[j][k])
                         if chain_aware and nxt > j + 1 else 0.0)
                if nxt == n:
                    final.extend(ParetoPoint(p.memory_bytes + stash, p.time_s + seg_cost, p.picks + seg_picks)
                                 for p in prefix)
                else:
                    for k2, c2 in enumerate(problem.choices[nxt]):
                        if c2.is_recompute:
                            continue
                        bucket = states[nxt].setdefault(k2, [])
                        bucket.extend(ParetoPoint(p.memory_bytes + stash + c2.memory_bytes,
                                                  p.time_s + seg_cost + c2.time_s,
                                                  p.picks + seg_picks + (k2,)) for p in prefix)
                if nxt < n and rec[nxt] is None:
                    break
        if j + 1 < n:
            for k2 in states[j + 1]:
                states[j + 1][k2] = _prune(states[j + 1][k2])
    return _prune(final)
