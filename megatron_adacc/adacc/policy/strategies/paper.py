"""The paper's MILP, eq. 4-8: one policy for every identical layer, additive recompute cost."""

from __future__ import annotations

import time

import pulp

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.strategies.base import (
    MS,
    SolveResult,
    best_over_caps,
    check_budget,
    finish_uniform,
    memory_unit,
    picked,
    run_cbc,
)

NAME = "paper"


def solve(problem: Problem) -> SolveResult:
    """Minimize sum_i T_comp_i R_i0 + (T_c_i + T_dc_i) R_i1 (eq. 4) subject to eq. 5-8 and the transient bound."""
    t0 = time.perf_counter()
    room = check_budget(problem)
    picks = best_over_caps(problem, room, lambda cap: _solve_capped(problem, room, cap), chain_aware=False)
    return finish_uniform(problem, NAME, picks or [], "Optimal" if picks else "Infeasible", t0, chain_aware=False)


def _solve_capped(problem: Problem, room: float | None, cap: float | None) -> list[int] | None:
    """The MILP with no compressed op larger than ``cap`` bytes (the largest decompressed op then costs at
    most ``cap`` in the backward bound); None when infeasible."""
    unit = memory_unit(room)
    prob = pulp.LpProblem("adacc_paper", pulp.LpMinimize)
    # R_{i,t}: one binary per op and choice; choices carry their own action (recompute/compress/keep).
    x = [[prob.add_variable(f"R_{i}_{k}", cat="Binary") for k in range(len(cs))]
         for i, cs in enumerate(problem.choices)]
    prob += pulp.lpSum(c.time_s * MS * x[i][k] for i, cs in enumerate(problem.choices) for k, c in enumerate(cs))
    for i, row in enumerate(x):
        prob += pulp.lpSum(row) == 1, f"eq5_one_choice_{i}"
    # eq. 6 (R_{1,0} = 0): the problem offers the first op no recompute choice (checked by Problem).
    if room is not None:
        for i, cs in enumerate(problem.choices):
            for k, c in enumerate(cs):
                if not c.is_recompute and c.remat_bytes > cap:
                    x[i][k].upBound = 0
        stored = problem.num_layers * pulp.lpSum(c.memory_bytes / unit * x[i][k]
                                                 for i, cs in enumerate(problem.choices) for k, c in enumerate(cs))
        recomputed = pulp.lpSum(c.remat_bytes / unit * x[i][k] for i, cs in enumerate(problem.choices)
                                for k, c in enumerate(cs) if c.is_recompute)
        # eq. 7-8, with the transient peak: max(workspace, one layer's re-materialization) as two bounds
        prob += stored + problem.workspace_bytes / unit <= room / unit, "eq7_eq8_memory"
        prob += stored + recomputed <= (room - cap) / unit, "eq7_eq8_memory_backward"
    status = run_cbc(prob)
    return picked(x) if status == "Optimal" else None
