"""Exhaustive search over uniform policies: the oracle the MILP strategies are tested against."""

from __future__ import annotations

import itertools
import time

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.strategies.base import SolveResult, check_budget, finish_uniform

NAME = "brute_force"
MAX_POLICIES = 2_000_000


def solve(problem: Problem, *, chain_aware: bool = False) -> SolveResult:
    t0 = time.perf_counter()
    check_budget(problem, stash=chain_aware)
    total = 1
    for cs in problem.choices:
        total *= len(cs)
    if total > MAX_POLICIES:
        raise ValueError(f"brute force would enumerate {total:,} policies (limit {MAX_POLICIES:,}); use the MILP")
    best, best_t = None, float("inf")
    for picks in itertools.product(*(range(len(cs)) for cs in problem.choices)):
        if problem.splits_a_read(picks):
            continue
        total = problem.total_memory([picks] * problem.num_layers, stash=chain_aware)
        if problem.budget_bytes is not None and total > problem.budget_bytes:
            continue
        t = problem.layer_time(picks, chain_aware=chain_aware)
        if t < best_t:
            best, best_t = list(picks), t
    status = "Optimal" if best is not None else "Infeasible"
    result = finish_uniform(problem, NAME, best or [], status, t0, chain_aware=chain_aware)
    return result
