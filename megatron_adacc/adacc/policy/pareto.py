"""Pareto-optimal single-layer policies (memory vs time), by dynamic programming over stored ops.

A layer policy is a sequence of stored ops (kept or compressed) separated by recompute segments, so the
DP state is "op j is stored with choice k": moving to the next stored op j' adds the segment j+1..j'-1
and the choice at j'.

Each point has three costs: the bytes the layer stores, its peak over its backward stages (the per-stage bound of
:mod:`megatron_adacc.adacc.policy.cost_model`) and the time. A point is dropped only when another is no worse in
all three: then it is no worse in any bound the solvers use (all layers' stored bytes + the workspace, and each
layer's peak beside the stored bytes of the layers below it: both grow with any layer's stored bytes and peak, so
replacing one layer's policy by one with at most its stored bytes and peak never raises them). So the smallest
feasible budget, every uniform optimum and every best two-policy mix are on the front.

The pruning of prefixes is exact too. After the DP has stored op j, every stage up to j is final (a stage only
holds what ops at or before it produced, and their segments are complete), so a prefix is its stored bytes, its
time, the largest of its final stages and what it leaves on the later stages beyond its stored bytes (a
decompression or a re-run still to come, bytes freed before their reader has run). Prefixes that leave the same
are compared on the first three.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from megatron_adacc.adacc.policy.cost_model import Choice, Problem
from megatron_adacc.adacc.policy.ops import candidate_segments


@dataclass(frozen=True)
class ParetoPoint:
    memory_bytes: float
    """Bytes the layer stores for backward."""
    time_s: float
    picks: tuple[int, ...]
    peak_bytes: float = 0.0
    """The layer's largest backward stage (:meth:`Problem.stage_bytes`)."""

    @property
    def excess_bytes(self) -> float:
        """The layer's backward excess: its peak over what it stores."""
        return self.peak_bytes - self.memory_bytes


def _prune(points: list, cost) -> list:
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


def least_mix_bytes(front: list[ParetoPoint], num_layers: int, workspace_bytes: float) -> float:
    """The least bytes above the fixed ones of a mix of two points of ``front``: the leaner point ``i`` in the
    lower ``L - m`` layers and the richer ``j`` in the upper ``1 <= m < L`` (infinite with one layer or one
    point). The mix peaks at the larger of the start of backward or a rich layer's stage, beside every stored
    byte (growing with ``m``), and the top lean layer's stage beside the lean layers only (shrinking with
    ``m``): the least is at an ``m`` beside where they cross."""
    L = num_layers
    if L < 2 or len(front) < 2:
        return float("inf")
    M = np.array([p.memory_bytes for p in front])
    R = np.array([p.excess_bytes for p in front])
    up = np.maximum(workspace_bytes, R[None, :])
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = (R[:, None] - up) / M[None, :]  # where the two terms of mix_bytes are equal
    best = np.inf
    for m in (np.floor(cross), np.ceil(cross)):
        m = np.clip(np.nan_to_num(m, nan=1.0, posinf=L - 1, neginf=1.0), 1, L - 1)
        best = min(best, float(mix_bytes(M, R, L, m, workspace_bytes).min()))
    return best


def mix_bytes(M: np.ndarray, R: np.ndarray, num_layers: int, m: np.ndarray, workspace_bytes: float) -> np.ndarray:
    """``[i, j]``: the bound's bytes above the fixed ones of point ``i`` (stored bytes ``M[i]``, backward excess
    ``R[i]``) in the lower ``L - m[i, j]`` layers and a richer point ``j`` in the upper ``m[i, j]``; infinite where
    ``j`` is not richer. The larger of the start of backward or a rich layer's stage, beside every stored byte,
    and the top lean layer's stage, beside the lean layers only (:meth:`Problem.total_memory` of that mix)."""
    lean, rich = M[:, None], M[None, :]
    stored = num_layers * lean + m * (rich - lean)
    peak = np.maximum(stored + np.maximum(workspace_bytes, R[None, :]), (num_layers - m) * lean + R[:, None])
    return np.where(rich > lean, peak, np.inf)


def _peak(p: ParetoPoint) -> float:
    return p.peak_bytes


def pareto_front(problem: Problem, *, chain_aware: bool) -> list[ParetoPoint]:
    """Every single-layer policy not dominated in (stored bytes, backward peak, time), by increasing memory."""
    n = problem.num_ops
    rec = [next((k for k, c in enumerate(cs) if c.is_recompute), None) for cs in problem.choices]
    recomputable = [k is not None for k in rec]
    grad = problem.grad_bytes

    def segment_time(seg: range, before: Choice) -> float:
        if chain_aware:
            return problem.segment_cost(seg.start, seg.stop - 1, before)
        return sum(problem.choices[i][rec[i]].time_s for i in seg)

    # where each stored choice is live, placed once: the DP extends every prefix with each of them
    placed = [[problem.choice_stages(j, c) for c in cs] for j, cs in enumerate(problem.choices)]
    # states[j][(k, ahead)]: prefixes 0..j that store op j with choice k and leave ``ahead`` on stages j+1..
    states: list[dict[tuple, list[_Prefix]]] = [dict() for _ in range(n)]
    start = _Prefix(0.0, 0.0, (), float("-inf"), (0.0,) * n)  # nothing stored; every stage ahead
    for k, c in enumerate(problem.choices[0]):
        if not c.is_recompute:
            _extend(states[0], start, k, c, placed[0][k], 0, -1, grad)
    final: list[ParetoPoint] = []
    for j in range(n):
        for (k, _), prefixes in states[j].items():
            before = problem.choices[j][k]
            for seg in candidate_segments(recomputable, j + 1):
                nxt = seg.stop
                seg_cost = segment_time(seg, before) if seg else 0.0
                seg_picks = tuple(rec[i] for i in seg)
                stages = (problem.segment_stages(seg.start, seg.stop - 1, before, stash=chain_aware) if seg else {})
                held = problem.segment_memory(seg.start, seg.stop - 1, before) if chain_aware and seg else 0.0
                for p in prefixes:
                    q = _Prefix(p.memory_bytes + held, p.time_s + seg_cost, p.picks + seg_picks, p.peak_bytes,
                                _add(p.ahead, stages, j, held))
                    if nxt == n:
                        peak = max([q.peak_bytes] + [grad[s] + q.memory_bytes + q.ahead[s - j - 1]
                                                     for s in range(j + 1, n)])
                        final.append(ParetoPoint(q.memory_bytes, q.time_s, q.picks, peak))
                        continue
                    for k2, c2 in enumerate(problem.choices[nxt]):
                        if not c2.is_recompute:
                            _extend(states[nxt], q, k2, c2, placed[nxt][k2], nxt, j, grad)
        if j + 1 < n:
            for key in states[j + 1]:
                states[j + 1][key] = _prune(states[j + 1][key], _peak)
    if problem.runtime_overhead_s:
        # every policy but keep-all pays the runtime's fixed cost: a constant over them, so the DP's pruning
        # among them holds, and keep-all (the most memory) cannot dominate any of them
        final = [p if problem.is_stock(p.picks) else
                 ParetoPoint(p.memory_bytes, p.time_s + problem.runtime_overhead_s, p.picks, p.peak_bytes)
                 for p in final]
    return _prune(final, _peak)


@dataclass(frozen=True)
class _Prefix:
    """Ops 0..j decided, op j stored (named as :class:`ParetoPoint`'s fields, so :func:`_prune` takes both)."""

    memory_bytes: float
    time_s: float
    picks: tuple[int, ...]
    peak_bytes: float
    """The largest final stage."""
    ahead: tuple[float, ...]
    """Bytes on each later stage beyond ``memory_bytes``, from the first stage not yet final."""


def _add(ahead: tuple[float, ...], stages: dict[int, float], last: int, held: float) -> tuple[float, ...]:
    """``ahead`` (stages after ``last``) plus ``stages``, less ``held``: bytes just added to the stored ones that
    ``stages`` already places."""
    out = list(ahead)
    for s, nbytes in stages.items():
        out[s - last - 1] += nbytes
    # list comprehensions, not generators: this runs for every prefix the DP extends
    return tuple([x - held for x in out]) if held else tuple(out)


def _extend(bucket: dict, q: _Prefix, k2: int, c2: Choice, placed: dict[int, float], nxt: int, last: int,
            grad: list[float]) -> None:
    """Store op ``nxt`` with choice ``k2`` (live at ``placed``) after prefix ``q``, whose ``ahead`` starts after
    stage ``last``: stages ``last + 1 .. nxt`` become final."""
    full = _add(q.ahead, placed, last, c2.memory_bytes)
    memory = q.memory_bytes + c2.memory_bytes
    peak = max([q.peak_bytes] + [grad[s] + memory + full[s - last - 1] for s in range(last + 1, nxt + 1)])
    rest = full[nxt - last:]
    key = (k2, tuple([round(x, 3) for x in rest]))
    bucket.setdefault(key, []).append(_Prefix(memory, q.time_s + c2.time_s, q.picks + (k2,), peak, rest))
