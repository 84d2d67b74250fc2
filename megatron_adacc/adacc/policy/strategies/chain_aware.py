"""Uniform policy with the chain-aware recompute cost (an improvement over the paper's eq. 4).

Consecutive recomputed ops ``a..b`` form one segment, recomputed from the nearest stored input at the
segment's own cost (:meth:`Problem.segment_cost`: the measured segment time, plus one more decompression
when that stored input is compressed), instead of the sum of per-op times.

A layer policy is a path through the stored ops, each edge a recompute segment between two of them, under
side constraints: the memory bound at the start of backward and at each of the layer's backward stages. That is
a resource-constrained shortest path, solved exactly by the Pareto DP (:func:`..pareto.pareto_front`), which
walks the same graph: one policy in every layer fits when ``N x stored + max(workspace, backward excess)`` does,
and both terms grow with the stored bytes and the peak, so the fastest Pareto point that fits is the optimum.
(It was a flow MILP over the graph's edges with one row per stage: exact too, but HiGHS took 0.2-0.4 s to
prove optimality on 14 ops where the DP takes 60 ms, and pipeline-parallel runs, which solve uniform policies,
pay that on every re-solve.)
"""

from __future__ import annotations

import time

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.pareto import pareto_front
from megatron_adacc.adacc.policy.strategies.base import SolveResult, check_budget, finish_uniform, prefer_stock

NAME = "chain_aware"


def solve(problem: Problem) -> SolveResult:
    t0 = time.perf_counter()
    room = check_budget(problem, stash=True)
    fitting = [p for p in pareto_front(problem, chain_aware=True) if room is None or problem.uniform_bytes(p) <= room]
    best = min(fitting, key=lambda p: p.time_s, default=None)
    picks = prefer_stock(problem, list(best.picks) if best else None, chain_aware=True)
    return finish_uniform(problem, NAME, picks or [], "Optimal" if picks else "Infeasible", t0, chain_aware=True)
