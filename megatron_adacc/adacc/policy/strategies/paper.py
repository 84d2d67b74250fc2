"""The paper's MILP, eq. 4-8: one policy for every identical layer, additive recompute cost."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.strategies.base import (
    MS,
    SolveResult,
    add_memory_bounds,
    check_budget,
    finish_uniform,
    memory_unit,
    picked,
    prefer_stock,
    run_milp,
    select_backend,
)

if TYPE_CHECKING:  # imported where the MILP is built (strategies.base)
    import pulp

NAME = "paper"


def solve(problem: Problem) -> SolveResult:
    """Minimize sum_i T_comp_i R_i0 + (T_c_i + T_dc_i) R_i1 (eq. 4) subject to eq. 5-8 and the backward stages."""
    t0 = time.perf_counter()
    room = check_budget(problem)
    backend = select_backend()
    picks = prefer_stock(problem, _solve(problem, room, backend), chain_aware=False)
    return finish_uniform(problem, NAME, picks or [], "Optimal" if picks else "Infeasible", t0, chain_aware=False,
                          backend=backend)


def _solve(problem: Problem, room: float | None, backend: str) -> list[int] | None:
    import pulp

    unit = memory_unit(room)
    prob = pulp.LpProblem("adacc_paper", pulp.LpMinimize)
    # R_{i,t}: one binary per op and choice; choices carry their own action (recompute/compress/keep).
    x = [[prob.add_variable(f"R_{i}_{k}", cat="Binary") for k in range(len(cs))]
         for i, cs in enumerate(problem.choices)]
    prob += pulp.lpSum(c.time_s * MS * x[i][k] for i, cs in enumerate(problem.choices) for k, c in enumerate(cs))
    for i, row in enumerate(x):
        prob += pulp.lpSum(row) == 1, f"eq5_one_choice_{i}"
    # eq. 6 (R_{1,0} = 0): the problem offers the first op no recompute choice (checked by Problem).
    rec = [next((k for k, c in enumerate(cs) if c.is_recompute), None) for cs in problem.choices]
    for p, r in problem.reads:  # no segment reads what another recomputes (ops.split_reads)
        if rec[p] is None or rec[r] is None:
            continue
        for m in range(p + 1, r):
            stored = 1 - x[m][rec[m]] if rec[m] is not None else 1
            prob += x[p][rec[p]] + stored + x[r][rec[r]] <= 2, f"one_segment_{p}_{m}_{r}"
    if room is not None:
        per_op = [pulp.lpSum(c.memory_bytes / unit * x[i][k] for k, c in enumerate(cs))
                  for i, cs in enumerate(problem.choices)]
        by_stage: list[list] = [[] for _ in range(problem.num_ops)]
        for i, cs in enumerate(problem.choices):
            for k, c in enumerate(cs):
                if not c.is_recompute:
                    for s, nbytes in problem.choice_stages(i, c).items():
                        by_stage[s].append(nbytes / unit * x[i][k])
        stages = [pulp.lpSum(terms) + _recomputed_at(prob, problem, x, rec, s, unit)
                  for s, terms in enumerate(by_stage)]
        add_memory_bounds(prob, problem, room, per_op, stages)  # eq. 7-8 with the backward and forward stages
    status = run_milp(prob, backend)
    return picked(x) if status == "Optimal" else None


def _recomputed_at(prob: pulp.LpProblem, problem: Problem, x: list, rec: list[int | None], s: int,
                   unit: float) -> pulp.LpAffineExpression:
    """The recomputed bytes live at stage ``s``: op k's values are (their share not yet freed) from their re-run
    down to their earliest readers, which reaches s when some op i of the segment is read at s or later, i.e. when ops
    k..i (or i..k) are all recomputed. A continuous ``z`` above each such conjunction carries op k's bytes; the
    bound only ever pushes it down, to the conjunction's value."""
    import pulp

    n = problem.num_ops
    terms = []
    for k in range(n):
        share = problem.held_share[k].get(s, 0.0)
        if rec[k] is None or not share or not problem.choices[k][rec[k]].remat_bytes:
            continue
        z = prob.add_variable(f"z_{k}_{s}", lowBound=0, upBound=1)
        for i in range(n):
            lo, hi = min(i, k), max(i, k)
            if problem.reach[i] < s or any(rec[j] is None for j in range(lo, hi + 1)):
                continue
            prob += z >= pulp.lpSum(x[j][rec[j]] for j in range(lo, hi + 1)) - (hi - lo), f"rerun_{k}_{s}_{i}"
        terms.append(problem.choices[k][rec[k]].remat_bytes * share / unit * z)
    return pulp.lpSum(terms)
