"""What every MILP strategy returns, and the helpers they share."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pulp

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.policy import Decision, Policy
from megatron_adacc.core.errors import AdaccError

MS = 1e3
"""Time enters the MILP in milliseconds; memory in units of 1/1000 of the room left for activations
(:func:`memory_unit`), so CBC's absolute tolerances stay meaningful for any budget size."""


def memory_unit(room: float | None) -> float:
    return max(room or 0.0, 1.0) / 1000.0


class InfeasibleBudgetError(AdaccError, ValueError):
    """No policy fits the memory budget."""

    def __init__(self, budget_bytes: float, min_feasible_bytes: int, detail: str = ""):
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        super().__init__(
            f"no Adacc policy fits the memory budget of {budget_bytes:,.0f} bytes ({budget_bytes / 2**30:.3f} GiB); "
            f"the smallest feasible budget is {min_feasible_bytes:,} bytes ({min_feasible_bytes / 2**30:.3f} GiB)"
            f"{detail}. Raise --adacc-memory-budget, or lower the micro-batch size or sequence length."
        )


@dataclass
class SolveResult:
    """One solution, whatever the strategy."""

    strategy: str
    layer_picks: list[list[int]]
    """Choice index per op, per layer (indices into ``Problem.choices``)."""
    decisions: list[list[Decision]]
    predicted_memory_bytes: float
    predicted_time_s: float
    """Per-micro-batch overhead over all layers, under the strategy's own cost model."""
    status: str
    solve_time_s: float
    chain_aware: bool
    heterogeneous: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def to_policy(self, *, signature: dict[str, Any] | None = None, budget_bytes: int | None = None,
                  profile_ref: dict[str, Any] | None = None, static_bytes: float | None = None,
                  name: str | None = "adacc") -> Policy:
        predicted = {"memory_bytes": int(round(self.predicted_memory_bytes)),
                     "time_s": self.predicted_time_s}
        if static_bytes is not None:
            predicted["static_bytes"] = int(static_bytes)
            predicted["activation_bytes"] = int(round(self.predicted_memory_bytes - static_bytes))
        solver = {"strategy": self.strategy, "status": self.status, "solve_time_s": self.solve_time_s,
                  "chain_aware": self.chain_aware, "heterogeneous": self.heterogeneous, **self.extra}
        return Policy(layers=[list(d) for d in self.decisions], signature=signature, budget_bytes=budget_bytes,
                      predicted=predicted, solver=solver, profile=profile_ref, name=name)


def check_budget(problem: Problem, *, stash: bool = False) -> float | None:
    """The bytes available to activations, or None when unbounded; raises when nothing fits."""
    if problem.budget_bytes is None:
        return None
    # A cheap lower bound first (every op at its least-memory choice, no transient); the exact smallest budget
    # needs the Pareto front, so it is computed only to name it in the error (here or when the solver finds
    # nothing).
    if problem.budget_bytes < problem.fixed_bytes + problem.num_layers * problem.min_layer_memory() - 0.5:
        raise InfeasibleBudgetError(problem.budget_bytes, problem.min_feasible_budget(stash=stash))
    return problem.budget_bytes - problem.fixed_bytes


def add_memory_bounds(prob: pulp.LpProblem, problem: Problem, room: float, stored: pulp.LpAffineExpression,
                      stages: list[pulp.LpAffineExpression]) -> None:
    """The memory bound of one policy used by every layer, linear (:mod:`..cost_model`): at the start of backward
    every layer holds what it stored beside the workspace, and at each backward stage s of the layer that runs
    its backward first the other layers hold what they stored. ``stored`` is one layer's stored bytes and
    ``stages[s]`` its bytes at stage s but the gradients, both in units of :func:`memory_unit`."""
    unit = memory_unit(room)
    others = problem.num_layers - 1
    prob += problem.num_layers * stored + problem.workspace_bytes / unit <= room / unit, "memory_start_of_backward"
    for s, live in enumerate(stages):
        prob += others * stored + live + problem.grad_bytes[s] / unit <= room / unit, f"memory_stage_{s}"


def prefer_stock(problem: Problem, picks: list[int] | None, *, chain_aware: bool) -> list[int] | None:
    """``picks``, or keep-everything where it fits and is no slower. The MILPs' objectives leave out the
    runtime's fixed cost, which only keep-everything escapes, so CBC may break that tie the other way."""
    keep = problem.stock_picks()
    if keep is None or (problem.budget_bytes is not None and problem.total_memory(
            [keep] * problem.num_layers, stash=chain_aware) > problem.budget_bytes):
        return picks
    if picks is None or problem.layer_time(keep, chain_aware=chain_aware) < problem.layer_time(
            picks, chain_aware=chain_aware):
        return keep
    return picks


def run_cbc(prob: pulp.LpProblem) -> str:
    """Solve with PuLP's bundled CBC (offline, silent) and return PuLP's status string."""
    prob.solve(cbc())
    return pulp.LpStatus[prob.status]


def cbc(**options: Any) -> pulp.LpSolver:
    """PuLP's bundled CBC binary, silent. PuLP 3.3 deprecates the bundled-binary class in favour of a
    separately installed CBC; the bundled one is what works offline, so its warning is silenced here."""
    bundled = getattr(pulp, "PULP_CBC_CMD", None)
    if bundled is None:  # PuLP 4 no longer ships CBC
        raise SolverUnavailable(
            f"PuLP {getattr(pulp, '__version__', '?')} has no bundled CBC solver, which Adacc's MILP uses; "
            "install a PuLP that has it: pip install 'pulp>=2.7,<4'")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bundled(msg=False, **options)


class SolverUnavailable(AdaccError, RuntimeError):
    """The MILP solver megatron-adacc uses is not installed."""


def picked(x: Sequence[Sequence[pulp.LpVariable]]) -> list[int]:
    """The chosen index of each one-hot row of binaries."""
    out = []
    for row in x:
        vals = [v.value() or 0.0 for v in row]
        out.append(max(range(len(vals)), key=vals.__getitem__))
    return out


def finish_uniform(problem: Problem, strategy: str, picks: list[int], status: str, t0: float,
                   *, chain_aware: bool) -> SolveResult:
    """Build a uniform result and verify it against the exact (unscaled) memory bound."""
    layers = [list(picks) for _ in range(problem.num_layers)]
    return finish(problem, strategy, layers, status, t0, chain_aware=chain_aware, heterogeneous=False)


def finish(problem: Problem, strategy: str, layers: list[list[int]], status: str, t0: float, *,
           chain_aware: bool, heterogeneous: bool, extra: dict[str, Any] | None = None) -> SolveResult:
    if status not in ("Optimal", "Feasible"):
        if status == "Infeasible":
            raise InfeasibleBudgetError(problem.budget_bytes or 0.0, problem.min_feasible_budget(stash=chain_aware),
                                        " (the solver proved it)")
        raise RuntimeError(f"{strategy}: CBC returned status {status!r}")
    memory = problem.total_memory(layers, stash=chain_aware)
    if problem.budget_bytes is not None and memory > problem.budget_bytes * (1 + 1e-7) + 1e-6:
        raise RuntimeError(f"{strategy}: solution uses {memory:,.0f} bytes, over the budget "
                           f"{problem.budget_bytes:,.0f} (solver tolerance); please report this")
    return SolveResult(
        strategy=strategy, layer_picks=layers, decisions=[problem.decisions(p) for p in layers],
        predicted_memory_bytes=memory, predicted_time_s=problem.total_time(layers, chain_aware=chain_aware),
        status=status, solve_time_s=time.perf_counter() - t0, chain_aware=chain_aware,
        heterogeneous=heterogeneous, extra=extra or {},
    )
