"""Uniform policy with the chain-aware recompute cost (an improvement over the paper's eq. 4).

Consecutive recomputed ops ``a..b`` form one segment, recomputed from the nearest stored input at the
segment's own cost (:meth:`Problem.segment_cost`: the measured segment time, plus one more decompression
when that stored input is compressed), instead of the sum of per-op times.

Formulation: a layer policy is a path through the stored ops. Node ``(j, k)`` means "op j is stored with
choice k"; an edge ``(j, k) -> (j', k')`` recomputes the ops between them as one segment. Binary edge
variables with flow conservation (one unit from source to sink) pick the path; an edge carries its exact
segment cost, the stored choice's time and memory, and the bytes both hold at each backward stage. The flow
polytope is integral, so the only non-network constraints are the memory bounds (eq. 7-8 at the start of
backward and at each of the layer's backward stages), which keeps the solver fast.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pulp

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.ops import candidate_segments
from megatron_adacc.adacc.policy.strategies.base import (
    MS,
    SolveResult,
    add_memory_bounds,
    check_budget,
    finish_uniform,
    memory_unit,
    prefer_stock,
    run_milp,
    select_backend,
)

NAME = "chain_aware"
SOURCE, SINK = "source", "sink"


def _edges(problem: Problem) -> list[tuple[object, object, float, float, dict[int, float], tuple[int, ...]]]:
    """(tail, head, time, stored bytes, bytes per backward stage, picks of the ops entered) for every edge of the
    policy graph."""
    n = problem.num_ops
    rec = [next((k for k, c in enumerate(cs) if c.is_recompute), None) for cs in problem.choices]
    recomputable = [k is not None for k in rec]
    edges = [(SOURCE, (0, k), c.time_s, c.memory_bytes, problem.choice_stages(0, c), (k,))
             for k, c in enumerate(problem.choices[0]) if not c.is_recompute]
    for j in range(n):
        for k, before in enumerate(problem.choices[j]):
            if before.is_recompute:
                continue
            for seg in candidate_segments(recomputable, j + 1):  # recompute seg, store op seg.stop next
                nxt = seg.stop
                cost = problem.segment_cost(seg.start, seg.stop - 1, before) if seg else 0.0
                seg_picks = tuple(rec[i] for i in seg)
                stash = problem.segment_memory(seg.start, seg.stop - 1, before) if seg else 0.0
                seg_stages = problem.segment_stages(seg.start, seg.stop - 1, before, stash=True) if seg else {}
                if nxt == n:
                    edges.append(((j, k), SINK, cost, stash, seg_stages, seg_picks))
                else:
                    for k2, c2 in enumerate(problem.choices[nxt]):
                        if not c2.is_recompute:
                            stages = dict(seg_stages)
                            for s, nbytes in problem.choice_stages(nxt, c2).items():
                                stages[s] = stages.get(s, 0.0) + nbytes
                            edges.append(((j, k), (nxt, k2), cost + c2.time_s, c2.memory_bytes + stash,
                                          stages, seg_picks + (k2,)))
    return edges


def solve(problem: Problem) -> SolveResult:
    t0 = time.perf_counter()
    room = check_budget(problem, stash=True)
    backend = select_backend()
    picks = prefer_stock(problem, _solve(problem, _edges(problem), room, backend), chain_aware=True)
    return finish_uniform(problem, NAME, picks or [], "Optimal" if picks else "Infeasible", t0, chain_aware=True,
                          backend=backend)


def _solve(problem: Problem, edges: list, room: float | None, backend: str) -> list[int] | None:
    """The flow MILP: one unit of flow from source to sink picks the layer's path of stored ops."""
    unit = memory_unit(room)
    prob = pulp.LpProblem("adacc_chain_aware", pulp.LpMinimize)
    e = [prob.add_variable(f"e_{i}", cat="Binary") for i in range(len(edges))]
    prob += pulp.lpSum(t * MS * v for (_, _, t, _, _, _), v in zip(edges, e))
    out_of, into = defaultdict(list), defaultdict(list)
    for (tail, head, _, _, _, _), v in zip(edges, e):
        out_of[tail].append(v)
        into[head].append(v)
    if not out_of[SOURCE] or not into[SINK]:
        return None
    prob += pulp.lpSum(out_of[SOURCE]) == 1, "source"
    prob += pulp.lpSum(into[SINK]) == 1, "sink"
    for node in set(out_of) | set(into):
        if node not in (SOURCE, SINK):
            prob += pulp.lpSum(into[node]) == pulp.lpSum(out_of[node]), f"flow_{node[0]}_{node[1]}"
    if room is not None:
        stored = pulp.lpSum(m / unit * v for (_, _, _, m, _, _), v in zip(edges, e))
        by_stage: list[list] = [[] for _ in range(problem.num_ops)]
        for (_, _, _, _, stages, _), v in zip(edges, e):
            for s, nbytes in stages.items():
                by_stage[s].append(nbytes / unit * v)
        add_memory_bounds(prob, problem, room, stored, [pulp.lpSum(terms) for terms in by_stage])
    if run_milp(prob, backend) != "Optimal":
        return None
    chosen = {tail: (head, p) for (tail, head, _, _, _, p), v in zip(edges, e) if (v.value() or 0) > 0.5}
    picks: list[int] = []
    node = SOURCE
    while node != SINK:
        node, p = chosen[node]
        picks.extend(p)
    return picks
