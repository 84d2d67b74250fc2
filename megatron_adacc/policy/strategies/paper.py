"""The paper's MILP, eq. 4-8: one policy for every identical layer, additive recompute cost."""

from __future__ import annotations

import time

import pulp

from megatron_adacc.policy.cost_model import Problem
from megatron_adacc.policy.strategies.base import (
    MS,
    SolveResult,
    check_budget,
    finish_uniform,
    memory_unit,
    picked,
    run_cbc,
)

NAME = "paper"


def solve(problem: Problem) -> SolveResult:
    """Minimize sum_i T_comp_i R_i0 + (T_c_i + T_dc_i) R_i1 (eq. 4) subject to eq. 5-8."""
    t0 = time.perf_counter()
    room = check_budget(problem)
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
        stored = problem.num_layers * pulp.lpSum(c.memory_bytes / unit * x[i][k]
                                                 for i, cs in enumerate(problem.choices) for k, c in enumerate(cs))
        remat = pulp.lpSum(c.remat_bytes / unit * x[i][k] for i, cs in enumerate(problem.choices)
                           for k, c in enumerate(cs))
        # eq. 7-8, with the transient peak: max(workspace, one layer's re-materialization) as two bounds
        prob += stored + problem.workspace_bytes / unit <= room / unit, "eq7_eq8_memory"
        prob += stored + remat <= room / unit, "eq7_eq8_memory_backward"
    status = run_cbc(prob)
    return finish_uniform(problem, NAME, picked(x) if status == "Optimal" else [], status, t0, chain_aware=False)
