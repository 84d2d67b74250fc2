"""Heterogeneous layers: each layer picks one Pareto-optimal single-layer policy (an improvement).

A budget between two uniform policies is met by giving some layers the cheaper, larger policy and the
rest a leaner one. Layers are identical, so only the number of layers per Pareto policy matters: integer
``n_p >= 0`` with ``sum n_p = N_layer``, ``M_fixed + sum n_p M_p + max(W, max_{n_p > 0} R_p) <= budget``
(R_p: policy p's backward excess, its peak backward stage over what it stores; W: the workspace), minimize
``sum n_p T_p``. Leaner policies take the lower layers, whose backward runs last, beside the stored bytes of
the layers below them only (:mod:`..cost_model`): so that sum is an upper bound of the peak, exact for a mix of
two policies, where step 1 below uses the exact one.
Any uniform policy is dominated by a Pareto point used in every layer, so this is never worse than the
uniform optimum under the same cost model.

That integer program is a cardinality-constrained knapsack whose optimality proof can take CBC seconds
(many near-equal mixes), so it is solved in two steps:

1. every mix of at most two Pareto policies, exactly and in closed form (for a leaner policy p below a
   richer q, the most q-layers that fit: the richer layers' stages beside everything stored, and the top
   leaner layer's beside the leaner layers only); the LP relaxation's optimum is such a mix, so this is the
   rounding of the relaxation and already contains every uniform policy;
2. the MILP (HiGHS or CBC) over the policies whose backward excess is no larger than step 1's answer's (so the
   transient term is a constant), warm-started from step 1, within ``time_limit_s``; its answer replaces step 1's
   when it is better. ``status`` is ``Optimal`` when the solver proved optimality and that restriction excluded
   no policy, else ``Feasible``.
"""

from __future__ import annotations

import time

import numpy as np

from megatron_adacc.adacc.policy.cost_model import Problem
from megatron_adacc.adacc.policy.pareto import ParetoPoint, mix_bytes, pareto_front
from megatron_adacc.adacc.policy.strategies.base import (
    MS,
    SolveResult,
    check_budget,
    finish,
    memory_unit,
    run_milp,
    select_backend,
)

NAME = "heterogeneous"
DEFAULT_TIME_LIMIT_S = 0.15


def best_two_policy_mix(front: list[ParetoPoint], num_layers: int, room: float | None,
                        workspace_bytes: float = 0.0) -> list[int]:
    """Layer counts per Pareto point of the best mix of at most two points that fits ``room`` bytes (the
    budget less the fixed bytes), the leaner point in the lower layers."""
    M = np.array([p.memory_bytes for p in front])
    R = np.array([p.excess_bytes for p in front])
    T = np.array([p.time_s for p in front])
    L = num_layers
    counts = [0] * len(front)
    if room is None:  # unbounded: the fastest point everywhere
        counts[int(np.argmin(T))] = L
        return counts
    # every point alone
    alone = np.where(L * M + np.maximum(workspace_bytes, R) <= room, L * T, np.inf)
    # lean point i in the lower L - m layers and rich point j in the upper 1 <= m < L: the start of backward
    # and the rich layers' stages sit beside all L layers' stored bytes, growing with m; the top lean layer's
    # beside the L - m lean layers' only, shrinking with m. So the most rich layers that fit the first is the
    # mix, if it fits the second.
    lean_m, rich_m = M[:, None], M[None, :]
    avail = room - np.maximum(workspace_bytes, R[None, :])
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.floor((avail - L * lean_m) / (rich_m - lean_m))
    m = np.where(rich_m > lean_m, np.clip(m, 0, L - 1), 0.0)
    fits = (m >= 1) & (mix_bytes(M, R, L, m, workspace_bytes) <= room)
    pair = np.where(fits, (L - m) * T[:, None] + m * T[None, :], np.inf)
    i, j = np.unravel_index(int(np.argmin(pair)), pair.shape)
    a = int(np.argmin(alone))
    if not np.isfinite(pair[i, j]) and not np.isfinite(alone[a]):
        return []
    if alone[a] <= pair[i, j]:
        counts[a] = L
    else:
        counts[i] += L - int(m[i, j])
        counts[j] += int(m[i, j])
    return counts


def solve(problem: Problem, *, chain_aware: bool = True, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S
          ) -> SolveResult:
    """``time_limit_s=None`` lets the MILP solver run until it proves optimality (small problems, tests)."""
    t0 = time.perf_counter()
    room = check_budget(problem, stash=chain_aware, heterogeneous=True)
    unit = memory_unit(room)
    front = pareto_front(problem, chain_aware=chain_aware)
    L = problem.num_layers
    W = problem.workspace_bytes
    counts = best_two_policy_mix(front, L, room, W)
    status = "Optimal" if counts else "Infeasible"
    proven = False
    backend = None
    if counts and len(front) > 2 and room is not None:
        import pulp

        backend = select_backend()
        prob = pulp.LpProblem("adacc_heterogeneous", pulp.LpMinimize)
        # The transient is fixed at step 1's (the largest backward excess among its policies, or the
        # workspace): only policies with no larger excess are offered, so the bound stays a plain
        # knapsack (a binary per policy to track the largest one used makes the relaxation too weak to help).
        peak = max([W] + [pt.excess_bytes for pt, c in zip(front, counts) if c])
        n = [prob.add_variable(f"n_{p}", lowBound=0, upBound=L if pt.excess_bytes <= peak else 0, cat="Integer")
             for p, pt in enumerate(front)]
        prob += pulp.lpSum(pt.time_s * MS * v for pt, v in zip(front, n))
        prob += pulp.lpSum(n) == L, "every_layer_one_policy"
        prob += (pulp.lpSum(pt.memory_bytes / unit * v for pt, v in zip(front, n)) <= (room - peak) / unit,
                 "memory")
        for v, c in zip(n, counts):
            v.setInitialValue(c)
        milp_status = run_milp(prob, backend, time_limit_s=time_limit_s, warm_start=True)
        if milp_status in ("Optimal", "Feasible"):
            proven = milp_status == "Optimal" and all(pt.excess_bytes <= peak for pt in front)
            milp = [int(round(v.value() or 0)) for v in n]
            if sum(milp) == L and _time(front, milp) < _time(front, counts) - 1e-12 and \
                    _memory(front, milp, W) <= room:
                counts = milp
    elif counts:
        proven = True  # two or fewer Pareto points (or no bound): the two-policy search is exhaustive
    layers: list[list[int]] = []
    # leaner (slower) policies first; within one pipeline stage the order does not change the peak
    for p in sorted(range(len(front)), key=lambda p: front[p].memory_bytes):
        layers.extend([list(front[p].picks)] * (counts[p] if counts else 0))
    name = NAME + ("+chain_aware" if chain_aware else "")
    if counts and not proven:
        status = "Feasible"  # best found within the time limit; the solver did not prove optimality
    return finish(problem, name, layers, status, t0, chain_aware=chain_aware, heterogeneous=True,
                  extra={"pareto_points": len(front), "proven_optimal": proven,
                         "distinct_layer_policies": sum(1 for c in counts if c)}, backend=backend)


def _time(front: list[ParetoPoint], counts: list[int]) -> float:
    return sum(c * p.time_s for c, p in zip(counts, front))


def _memory(front: list[ParetoPoint], counts: list[int], workspace_bytes: float) -> float:
    """Bytes above the fixed ones: every layer's stored bytes and the transient peak."""
    return (sum(c * p.memory_bytes for c, p in zip(counts, front))
            + max([workspace_bytes] + [p.excess_bytes for c, p in zip(counts, front) if c]))
