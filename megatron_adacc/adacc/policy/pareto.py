"""Pareto-optimal single-layer policies (memory vs time), by dynamic programming over stored ops.

A layer policy is a sequence of stored ops (kept or compressed) separated by recompute segments, so the
DP state is "op j is stored with choice k": moving to the next stored op j' adds the segment j+1..j'-1
and the choice at j'.

Each point has three costs: the bytes the layer stores, its peak over its backward and forward stages (the bound of
:mod:`megatron_adacc.adacc.policy.cost_model`) and the time. A point is dropped only when another is no worse in
all three: then it is no worse in any bound the solvers use (all layers' stored bytes + the workspace, and each
layer's peak beside the stored bytes of the layers below it: both grow with any layer's stored bytes and peak, so
replacing one layer's policy by one with at most its stored bytes and peak never raises them). So the smallest
feasible budget, every uniform optimum and every best two-policy mix are on the front.

Policies where a recompute segment reads an output another segment recomputes are left out
(:func:`~megatron_adacc.adacc.policy.ops.split_reads`): the earlier segment would re-run at the later one's stage,
so its stages would depend on what follows. A prefix carries which of its recomputed ops later ops still read,
and which of its stored ops (with their choices) a later segment may hold an output of: a segment holding
``context`` holds ``linear_qkv``'s outputs, stored as that op's choice says, past the ops between them.

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


def _front(memory: np.ndarray, time: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """The indices of the points no other point matches or beats in memory, time and cost (ties: the first),
    by increasing memory.

    Sorted by memory, a point can only be dominated by an earlier one that is no slower and no costlier; the
    earlier kept points are summarized by their (time, cost) staircase, so each check is a binary search.
    """
    order = np.lexsort((cost, time, memory))  # stable: equal points keep their order
    stair_t: list[float] = []  # increasing time ...
    stair_c: list[float] = []  # ... strictly decreasing cost
    out: list[int] = []
    for i, t, c in zip(order.tolist(), time[order].tolist(), cost[order].tolist()):
        at = bisect.bisect_right(stair_t, t)
        if at and stair_c[at - 1] <= c:  # the cheapest earlier point at least as fast is no costlier
            continue
        out.append(i)
        end = at
        while end < len(stair_t) and stair_c[end] >= c:  # staircase points this one now covers
            end += 1
        stair_t[at:end] = [t]
        stair_c[at:end] = [c]
    return np.asarray(out, dtype=np.intp)


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


def pareto_front(problem: Problem, *, chain_aware: bool) -> list[ParetoPoint]:
    """Every single-layer policy not dominated in (stored bytes, backward peak, time), by increasing memory."""
    n = problem.num_ops
    rec = [next((k for k, c in enumerate(cs) if c.is_recompute), None) for cs in problem.choices]
    recomputable = [k is not None for k in rec]
    grad = problem.grad_bytes
    readers: dict[int, list[int]] = {}
    for p, r in problem.reads:
        readers.setdefault(p, []).append(r)

    def still_read(ops, after: int) -> tuple[int, ...]:
        """The recomputed ``ops`` that an op after ``after`` reads past the ops between them."""
        return tuple(sorted(p for p in ops if any(r > after for r in readers.get(p, ()))))

    def stored_pick(pk: tuple[int, int]) -> tuple[int, Choice]:
        return pk[0], problem.choices[pk[0]][pk[1]]

    def segment_time(seg: range, stored: dict[int, Choice]) -> float:
        if chain_aware:
            return problem.segment_cost(seg.start, seg.stop - 1, stored)
        return sum(problem.choices[i][rec[i]].time_s for i in seg)

    # where each stored choice is live, placed once: the DP extends every group of prefixes with each of them
    placed = [[problem.choice_stages(j, c) for c in cs] for j, cs in enumerate(problem.choices)]
    # each op's forward stage: the prefix's stored bytes when it runs, plus this (Problem.forward_stages)
    forward = problem.forward_live or [-np.inf] * n
    # states[j][(k, ahead, pending, carried)]: the prefixes 0..j that store op j with choice k, leave ``ahead`` on
    # stages j+1.., recompute the ops ``pending`` that later ops read and store the ops ``carried`` ((op, choice)
    # pairs) whose outputs a later segment may hold or decompress; while op j's are being collected, the groups
    # each extension made
    states: list[dict[tuple, list[_Prefixes]]] = [dict() for _ in range(n)]
    start = _Prefixes((0.0,) * n, np.zeros(1), np.zeros(1), np.full(1, -np.inf), [()])  # nothing stored yet
    for k, c in enumerate(problem.choices[0]):
        if not c.is_recompute:
            _extend(states[0], start, k, c, placed[0][k], 0, -1, grad, (), (), forward[0])
    final: list[_Prefixes] = []
    for j in range(n):
        group = {key: _Prefixes.merge(parts) for key, parts in states[j].items()}
        for (k, _, pending, carried), prefixes in group.items():
            before = problem.choices[j][k]
            stored = {p: problem.choices[p][kp] for p, kp in carried}
            stored[j] = before
            for seg in candidate_segments(recomputable, j + 1):
                if any(r in seg for p in pending for r in readers[p]):
                    continue  # it would read what an earlier segment recomputes
                nxt = seg.stop
                stages = (problem.segment_stages(seg.start, seg.stop - 1, stored, stash=chain_aware) if seg else {})
                reruns = bool(seg) and max(problem.reach[seg.start:seg.stop]) >= 0
                held = problem.segment_memory(seg.start, seg.stop - 1, stored) if chain_aware and reruns else 0.0
                seg_picks = tuple(rec[i] for i in seg)
                peak = (np.maximum(prefixes.peak, prefixes.memory + held + max(forward[i] for i in seg)) if seg
                        else prefixes.peak)
                q = _Prefixes(_add(prefixes.ahead, stages, j, held), prefixes.memory + held,
                              prefixes.time + (segment_time(seg, stored) if seg else 0.0), peak,
                              [p + seg_picks for p in prefixes.picks] if seg_picks else prefixes.picks)
                if nxt == n:  # the layer ends: every stage left is final
                    tail = max((grad[s] + q.ahead[s - j - 1] for s in range(j + 1, n)), default=-np.inf)
                    final.append(_Prefixes((), q.memory, q.time, np.maximum(q.peak, q.memory + tail), q.picks))
                    continue
                ahead_reads = still_read([*pending, *seg], nxt)
                ahead_stored = (tuple(pk for pk in (*carried, (j, k)) if problem.carries(*stored_pick(pk), nxt))
                                if chain_aware else ())
                for k2, c2 in enumerate(problem.choices[nxt]):
                    if not c2.is_recompute:
                        _extend(states[nxt], q, k2, c2, placed[nxt][k2], nxt, j, grad, ahead_reads, ahead_stored,
                                forward[nxt])
    points = _Prefixes.merge(final)
    if problem.runtime_overhead_s:
        # every policy but keep-all pays the runtime's fixed cost: a constant over them, so the DP's pruning
        # among them holds, and keep-all (the most memory) cannot dominate any of them
        points.time = points.time + np.array([0.0 if problem.is_stock(p) else problem.runtime_overhead_s
                                              for p in points.picks])
    wholes = problem.whole_recompute_picks() if problem.layer_recompute_s is not None else []
    if wholes:
        # a layer recomputed whole runs megatron's own recompute, at its measured time, which the DP (pricing the
        # decomposition) may have pruned for a policy faster than the decomposition: it joins the front here
        points.time = np.array([problem.layer_time(p, chain_aware=chain_aware) if problem.recomputes_whole_layer(p)
                                else t for p, t in zip(points.picks, points.time.tolist())])
        present = set(points.picks)
        for whole in (w for w in wholes if tuple(w) not in present):
            peak = max(problem.stage_bytes(whole, stash=chain_aware) + problem.forward_stages(whole, stash=chain_aware))
            points = _Prefixes((), np.append(points.memory, problem.layer_memory(whole, stash=chain_aware)),
                               np.append(points.time, problem.layer_time(whole, chain_aware=chain_aware)),
                               np.append(points.peak, peak), [*points.picks, tuple(whole)])
    return [ParetoPoint(float(points.memory[i]), float(points.time[i]), points.picks[i], float(points.peak[i]))
            for i in _front(points.memory, points.time, points.peak).tolist()]


@dataclass
class _Prefixes:
    """Prefixes over ops 0..j that store op j with the same choice and leave the same bytes on the stages not yet
    final: the DP's unit of work, one array entry per prefix, so extending them is a few vector operations."""

    ahead: tuple[float, ...]
    """Bytes on each later stage beyond a prefix's stored bytes, from the first stage not yet final."""
    memory: np.ndarray
    """Stored bytes."""
    time: np.ndarray
    peak: np.ndarray
    """The largest final stage."""
    picks: list[tuple[int, ...]]

    @staticmethod
    def merge(parts: list[_Prefixes]) -> _Prefixes:
        """One group of ``parts`` (their ``ahead`` equal, to rounding) without the prefixes another dominates:
        those can be replaced in any completed policy, since the rest of the layer adds the same to each."""
        if len(parts) == 1:
            g = parts[0]
        else:
            g = _Prefixes(parts[0].ahead, np.concatenate([p.memory for p in parts]),
                          np.concatenate([p.time for p in parts]), np.concatenate([p.peak for p in parts]),
                          [t for p in parts for t in p.picks])
        keep = _front(g.memory, g.time, g.peak)
        if len(keep) == len(g.picks):
            return g
        return _Prefixes(g.ahead, g.memory[keep], g.time[keep], g.peak[keep], [g.picks[i] for i in keep.tolist()])


def _add(ahead: tuple[float, ...], stages: dict[int, float], last: int, held: float) -> tuple[float, ...]:
    """``ahead`` (stages after ``last``) plus ``stages``, less ``held``: bytes just added to the stored ones that
    ``stages`` already places."""
    out = list(ahead)
    for s, nbytes in stages.items():
        out[s - last - 1] += nbytes
    return tuple([x - held for x in out]) if held else tuple(out)


def _extend(bucket: dict, q: _Prefixes, k2: int, c2: Choice, placed: dict[int, float], nxt: int, last: int,
            grad: list[float], pending: tuple[int, ...], carried: tuple[tuple[int, int], ...], forward: float) -> None:
    """Store op ``nxt`` with choice ``k2`` (live at ``placed``) after prefixes ``q``, whose ``ahead`` starts after
    stage ``last``: stages ``last + 1 .. nxt`` become final. ``pending``: the prefixes' recomputed ops that ops after
    ``nxt`` read; ``carried``: their stored ops whose outputs a segment after ``nxt`` may hold; ``forward``: what op
    ``nxt``'s forward holds beside the prefixes' stored bytes."""
    full = _add(q.ahead, placed, last, c2.memory_bytes)
    memory = q.memory + c2.memory_bytes
    final = max(grad[s] + full[s - last - 1] for s in range(last + 1, nxt + 1))
    rest = full[nxt - last:]
    key = (k2, tuple([round(x, 3) for x in rest]), pending, carried)
    peak = np.maximum(np.maximum(q.peak, memory + final), q.memory + forward)
    bucket.setdefault(key, []).append(_Prefixes(rest, memory, q.time + c2.time_s, peak, [p + (k2,) for p in q.picks]))
