"""Solver strategies, one per file (Checkmate style); each returns a :class:`SolveResult`.

* ``paper``          eq. 4-8 of the Adacc paper, an MILP: one policy for all layers, additive recompute cost.
* ``chain_aware``    the same with segment-aware recompute cost, exactly by the Pareto DP.
* ``heterogeneous``  per-layer choice among Pareto-optimal single-layer policies (either cost model).
* ``brute_force``    exhaustive oracle for small problems.
"""

from __future__ import annotations

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.strategies import brute_force, chain_aware, heterogeneous, paper
from megatron_adacc.adacc.policy.strategies import chain_aware as _chain_aware_mod
from megatron_adacc.adacc.policy.strategies import heterogeneous as _heterogeneous_mod
from megatron_adacc.adacc.policy.strategies.base import InfeasibleBudgetError, SolveResult

__all__ = ["InfeasibleBudgetError", "SolveResult", "solve", "brute_force", "chain_aware", "heterogeneous", "paper"]


def solve(problem: Problem, *, chain_aware: bool = True, heterogeneous: bool = True) -> SolveResult:
    """Solve with the paper's formulation plus the chosen improvements."""
    if heterogeneous:
        return _heterogeneous_mod.solve(problem, chain_aware=chain_aware)
    if chain_aware:
        return _chain_aware_mod.solve(problem)
    return paper.solve(problem)
