"""What every MILP strategy returns, and the helpers they share."""

from __future__ import annotations

import ctypes
import functools
import inspect
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.policy import Decision, Policy
from megatron_adacc.core.errors import AdaccError

if TYPE_CHECKING:  # PuLP (and the backend it loads) only where an MILP is built: a training process that solves
    import pulp  # in a child (adacc.integration.auto) never holds them

MS = 1e3
"""Time enters the MILP in milliseconds; memory in units of 1/1000 of the room left for activations
(:func:`memory_unit`), so the solvers' absolute tolerances stay meaningful for any budget size."""


def memory_unit(room: float | None) -> float:
    return max(room or 0.0, 1.0) / 1000.0


class InfeasibleBudgetError(AdaccError, ValueError):
    """No policy fits the memory budget."""

    def __init__(self, budget_bytes: float, min_feasible_bytes: int, detail: str = ""):
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.detail = detail
        super().__init__(
            f"no Adacc policy fits the memory budget of {budget_bytes:,.0f} bytes ({budget_bytes / 2**30:.3f} GiB); "
            f"the smallest feasible budget is {min_feasible_bytes:,} bytes ({min_feasible_bytes / 2**30:.3f} GiB)"
            f"{detail}. Raise --adacc-memory-budget, or lower the micro-batch size or sequence length."
        )

    def __reduce__(self):  # noqa: ANN204 - pickled back from a solve in a child process (compat.process.forked)
        return type(self), (self.budget_bytes, self.min_feasible_bytes, self.detail)


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
    backend: str | None = None
    """The MILP backend that solved it (:data:`BACKENDS`); None when no MILP ran (closed form, brute force)."""

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
        if self.backend is not None:
            solver["backend"] = self.backend
        return Policy(layers=[list(d) for d in self.decisions], signature=signature, budget_bytes=budget_bytes,
                      predicted=predicted, solver=solver, profile=profile_ref, name=name)


def check_budget(problem: Problem, *, stash: bool = False, heterogeneous: bool = False) -> float | None:
    """The bytes available to activations, or None when unbounded; raises when nothing fits."""
    if problem.budget_bytes is None:
        return None
    # A cheap lower bound first (every op at its least-memory choice, no transient); the exact smallest budget
    # needs the Pareto front, so it is computed only to name it in the error (here or when the solver finds
    # nothing).
    if problem.budget_bytes < problem.fixed_bytes + problem.num_layers * problem.min_layer_memory() - 0.5:
        raise InfeasibleBudgetError(problem.budget_bytes,
                                    problem.min_feasible_budget(stash=stash, heterogeneous=heterogeneous))
    return problem.budget_bytes - problem.fixed_bytes


def add_memory_bounds(prob: pulp.LpProblem, problem: Problem, room: float, per_op: list[pulp.LpAffineExpression],
                      stages: list[pulp.LpAffineExpression]) -> None:
    """The memory bound of one policy used by every layer, linear (:mod:`..cost_model`): every layer holds what it
    stored beside the workspace at the start of backward; at each backward stage s of the layer that runs its
    backward first, and at each op's forward in the last layer, the other layers hold what they stored.
    ``per_op[i]`` is op i's stored bytes in one layer and ``stages[s]`` the layer's bytes at stage s but the
    gradients, both in units of :func:`memory_unit`."""
    import pulp

    unit = memory_unit(room)
    others = problem.num_layers - 1
    stored = pulp.lpSum(per_op)
    prob += problem.num_layers * stored + problem.workspace_bytes / unit <= room / unit, "memory_start_of_backward"
    for s, live in enumerate(stages):
        prob += others * stored + live + problem.grad_bytes[s] / unit <= room / unit, f"memory_stage_{s}"
    for i, live in enumerate(problem.forward_live or []):
        prob += others * stored + pulp.lpSum(per_op[:i]) + live / unit <= room / unit, f"memory_forward_{i}"


def prefer_stock(problem: Problem, picks: list[int] | None, *, chain_aware: bool) -> list[int] | None:
    """``picks``, or keep-everything where it fits and is no slower. The MILPs' objectives leave out the
    runtime's fixed cost, which only keep-everything escapes, so the solver may break that tie the other way."""
    keep = problem.stock_picks()
    if keep is None or (problem.budget_bytes is not None and problem.total_memory(
            [keep] * problem.num_layers, stash=chain_aware) > problem.budget_bytes):
        return picks
    if picks is None or problem.layer_time(keep, chain_aware=chain_aware) < problem.layer_time(
            picks, chain_aware=chain_aware):
        return keep
    return picks


SOLVER_ENV = "ADACC_MILP_SOLVER"
"""Environment variable that forces a MILP backend: ``highs``, ``cbc`` or ``auto`` (the default)."""
BACKENDS = ("highs", "cbc")
"""The MILP backends PuLP hands our models to, most preferred first: HiGHS (``highspy``, a wheel on every Python
we support, usually much faster on these MILPs) and CBC (bundled by PuLP < 4; PuLP 4 runs a ``cbc`` binary)."""
_INSTALL = {"highs": "pip install highspy", "cbc": "pip install 'pulp<4' (it bundles CBC) or put cbc on PATH"}
_FORCED: ContextVar[str | None] = ContextVar("adacc_milp_backend", default=None)


class SolverUnavailable(AdaccError, RuntimeError):
    """No MILP backend megatron-adacc can use is installed (or the one asked for is not)."""


def available_backends() -> list[str]:
    """The MILP backends installed here, most preferred first."""
    return [name for name in BACKENDS if _solver_class(name) is not None]


def select_backend(name: str | None = None) -> str:
    """The backend to solve with: ``name``, else the one :func:`milp_backend` set, else ``$ADACC_MILP_SOLVER``,
    else the first installed of :data:`BACKENDS`. Raises :class:`SolverUnavailable` naming the install command."""
    import pulp

    wanted = (name or _FORCED.get() or os.environ.get(SOLVER_ENV) or "auto").strip().lower()
    if wanted != "auto" and wanted not in BACKENDS:
        raise SolverUnavailable(f"{SOLVER_ENV}={wanted!r} is not a MILP backend: use one of "
                                f"{', '.join(BACKENDS)} or auto")
    for backend in BACKENDS if wanted == "auto" else (wanted,):
        if _solver_class(backend) is not None:
            return backend
    pulp_version = getattr(pulp, "__version__", "?")
    if wanted == "auto":
        raise SolverUnavailable(f"PuLP {pulp_version} has no MILP solver installed (HiGHS or CBC), which Adacc's "
                                f"policy solver needs: {_INSTALL['highs']}")
    raise SolverUnavailable(f"{SOLVER_ENV}={wanted} but {wanted} is not installed for PuLP {pulp_version}: "
                            f"{_INSTALL[wanted]}")


@contextmanager
def milp_backend(name: str) -> Iterator[str]:
    """Solve with ``name`` inside the block (benchmarks compare backends); refused at once when not installed."""
    backend = select_backend(name)
    token = _FORCED.set(backend)
    try:
        yield backend
    finally:
        _FORCED.reset(token)


def _solver_class(backend: str) -> type | None:
    """PuLP's solver class for ``backend`` when it can run here, else None. PuLP < 4 bundles CBC as
    ``PULP_CBC_CMD``; PuLP 4 dropped it, and its ``COIN_CMD`` runs a CBC found on PATH (or pulp[cbc]'s)."""
    import pulp

    names = ("HiGHS",) if backend == "highs" else ("PULP_CBC_CMD", "COIN_CMD")
    for attr in names:
        cls = getattr(pulp, attr, None)
        if cls is None:
            continue
        with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC, which is what works offline
            warnings.simplefilter("ignore", DeprecationWarning)
            if cls(msg=False).available():
                return cls
    return None


def milp_solver(backend: str, *, time_limit_s: float | None = None, warm_start: bool = False) -> pulp.LpSolver:
    """A silent PuLP solver for ``backend``. Both backends run to a proven optimum (no relative gap: HiGHS's
    default of 1e-4 could stop on a slower policy than the one CBC proves best), within ``time_limit_s`` when
    given; ``warm_start`` hands the variables' initial values over where the PuLP version supports it for the
    backend (PuLP 3's HiGHS does not)."""
    cls = _solver_class(backend)
    if cls is None:
        select_backend(backend)  # raises, naming the install command
    options: dict[str, Any] = {"msg": False}
    if time_limit_s is not None:
        options["timeLimit"] = time_limit_s
    if backend == "highs":
        options["gapRel"] = 0.0
        _swallow_highs_banner()
    if warm_start and "warmStart" in inspect.signature(cls.__init__).parameters:
        options["warmStart"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cls(**options)


@functools.cache
def _swallow_highs_banner() -> None:
    """HiGHS prints a copyright banner to the C stdout when a process makes its first solver, before any option
    can silence it, and every ``adacc`` command that solves would show it; that first solver is made here with
    the C stdout pointed at /dev/null (flushed, since a pipe buffers it)."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
            try:
                ctypes.CDLL(None).fflush(None)
            except (OSError, AttributeError, TypeError):  # no C runtime to flush by that name (Windows)
                pass
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def run_milp(prob: pulp.LpProblem, backend: str, *, time_limit_s: float | None = None,
             warm_start: bool = False) -> str:
    """Solve ``prob`` with ``backend``: ``"Optimal"`` (proven), ``"Feasible"`` (a solution, e.g. at the time
    limit), ``"Infeasible"``, or the solver's word for anything else. PuLP 4 returns the outcome; PuLP 3 leaves
    it on the problem."""
    import pulp

    outcome = prob.solve(milp_solver(backend, time_limit_s=time_limit_s, warm_start=warm_start))
    if hasattr(outcome, "has_solution"):
        proven = outcome.status == pulp.LpSolveStatus.Optimal
        if outcome.has_solution:
            return "Optimal" if proven else "Feasible"
        return "Infeasible" if outcome.status == pulp.LpSolveStatus.Infeasible else outcome.status_str
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "Optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "Feasible"
    return pulp.LpStatus[prob.status]


def picked(x: Sequence[Sequence[pulp.LpVariable]]) -> list[int]:
    """The chosen index of each one-hot row of binaries."""
    out = []
    for row in x:
        vals = [v.value() or 0.0 for v in row]
        out.append(max(range(len(vals)), key=vals.__getitem__))
    return out


def finish_uniform(problem: Problem, strategy: str, picks: list[int], status: str, t0: float,
                   *, chain_aware: bool, backend: str | None = None) -> SolveResult:
    """Build a uniform result and verify it against the exact (unscaled) memory bound."""
    layers = [list(picks) for _ in range(problem.num_layers)]
    return finish(problem, strategy, layers, status, t0, chain_aware=chain_aware, heterogeneous=False,
                  backend=backend)


def finish(problem: Problem, strategy: str, layers: list[list[int]], status: str, t0: float, *,
           chain_aware: bool, heterogeneous: bool, extra: dict[str, Any] | None = None,
           backend: str | None = None) -> SolveResult:
    """Build a result and verify it against the exact (unscaled) memory bound."""
    if status not in ("Optimal", "Feasible"):
        if status == "Infeasible":
            raise InfeasibleBudgetError(problem.budget_bytes or 0.0,
                                        problem.min_feasible_budget(stash=chain_aware, heterogeneous=heterogeneous),
                                        " (the solver proved it)")
        raise RuntimeError(f"{strategy}: the MILP solver ({backend}) returned status {status!r}")
    memory = problem.total_memory(layers, stash=chain_aware)
    if problem.budget_bytes is not None and memory > problem.budget_bytes * (1 + 1e-7) + 1e-6:
        raise RuntimeError(f"{strategy}: solution uses {memory:,.0f} bytes, over the budget "
                           f"{problem.budget_bytes:,.0f} (solver tolerance); please report this")
    return SolveResult(
        strategy=strategy, layer_picks=layers, decisions=[problem.decisions(p) for p in layers],
        predicted_memory_bytes=memory, predicted_time_s=problem.total_time(layers, chain_aware=chain_aware),
        status=status, solve_time_s=time.perf_counter() - t0, chain_aware=chain_aware,
        heterogeneous=heterogeneous, extra=extra or {}, backend=backend,
    )
