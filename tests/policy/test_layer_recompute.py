"""A layer that keeps its input and recomputes everything else runs megatron's own full recompute
(``runtime.checkpoint.recomputed_layer_forward``), and the cost model prices it at that path's measured time
(``LayerProfile.layer_recompute_s``) instead of the decomposition's: the Pareto front and the solver see it, and
agree with brute force. The runtime side: tests/runtime/test_floor.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_adacc.adacc.policy.cost_model import build_problem
from megatron_adacc.adacc.policy.ops import Action
from megatron_adacc.adacc.policy.pareto import pareto_front
from megatron_adacc.adacc.policy.policy import Decision
from megatron_adacc.adacc.policy.profile import analytic_profile
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy
from megatron_adacc.adacc.policy.strategies import brute_force

SIG = plain_signature(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, seq_length=128,
                      micro_batch_size=4, dtype="float32", num_layers=6, megatron_core_version="0.16.1")


def _lossless(op: str, d: Decision) -> bool:
    return d.action != Action.COMPRESS


def _whole(problem) -> list[int]:
    return [next(k for k, c in enumerate(cs) if c.decision.action == (Action.KEEP if i == 0 else Action.RECOMPUTE))
            for i, cs in enumerate(problem.choices)]


@pytest.mark.parametrize("fast", [True, False])
def test_the_front_and_brute_force_price_it_as_measured(fast: bool) -> None:
    """Megatron's recompute measured far below the decomposition's (or far above it): the front's fastest fitting
    policy is brute force's, at a budget the whole-layer recompute fits."""
    plain = build_problem(analytic_profile(SIG), None, allow=_lossless)
    whole = _whole(plain)
    decomposed = plain.layer_time(whole, chain_aware=True)
    problem = replace(plain, layer_recompute_s=decomposed * (0.01 if fast else 100.0))
    assert problem.recomputes_whole_layer(whole) and not problem.recomputes_whole_layer(plain.stock_picks())
    assert problem.layer_time(whole, chain_aware=True) == problem.layer_recompute_s
    budget = problem.total_memory([whole] * problem.num_layers, stash=True) * 1.5
    problem = replace(problem, budget_bytes=budget)
    fits = [p for p in pareto_front(problem, chain_aware=True)
            if problem.total_memory([list(p.picks)] * problem.num_layers, stash=True) <= budget]
    want = brute_force.solve(problem, chain_aware=True)
    assert problem.num_layers * min(p.time_s for p in fits) == pytest.approx(want.predicted_time_s, rel=1e-9)
    assert (want.layer_picks[0] == whole) is fast


def test_the_solver_takes_megatron_s_recompute_where_it_is_the_faster() -> None:
    """Little room beside six layers recomputed whole: priced as the decomposition, the solver finds faster mixes;
    priced as measured for megatron's recompute (here all but free), it takes megatron's own block layout:
    layers recomputed whole, the rest keeping everything."""
    profile = analytic_profile(SIG)
    plain = build_problem(profile, None)
    whole = [plain.choices[i][k].decision for i, k in enumerate(_whole(plain))]
    keep = [plain.choices[i][k].decision for i, k in enumerate(plain.stock_picks())]
    budget = plain.total_memory([_whole(plain)] * plain.num_layers, stash=True) * 1.02
    slow, _ = solve_policy(profile, budget, SolveOptions(headroom=0.0, mlp_tiles=1))
    assert whole not in slow.layers
    profile.layer_recompute_s = 1e-9
    fast, result = solve_policy(profile, budget, SolveOptions(headroom=0.0, mlp_tiles=1))
    assert all(layer in (whole, keep) for layer in fast.layers) and whole in fast.layers
    assert result.predicted_time_s == pytest.approx(fast.layers.count(whole) * 1e-9)


def test_a_compressed_input_recomputed_whole_costs_megatron_s_recompute_and_its_codec() -> None:
    """The floor (the input compressed, the rest recomputed) runs megatron's recompute too: priced at its measured
    time plus the input codec's, it joins the front, and at a budget where a kept input no longer fits, brute
    force and the front both take it."""
    def allow(op: str, d: Decision) -> bool:
        return d.action != Action.COMPRESS or op == "layer_input"

    plain = build_problem(analytic_profile(SIG), None, allow=allow)
    wholes = plain.whole_recompute_picks()
    assert sorted(plain.choices[0][w[0]].decision.action.value for w in wholes) == ["compress", "keep"]
    kept, squeezed = sorted(wholes, key=lambda w: plain.choices[0][w[0]].decision.action != Action.KEEP)
    problem = replace(plain, layer_recompute_s=1e-6)
    codec = plain.choices[0][squeezed[0]].time_s
    assert codec > 0 and problem.recomputes_whole_layer(squeezed)
    assert problem.layer_time(squeezed, chain_aware=True) == pytest.approx(1e-6 + codec)
    budget = problem.total_memory([squeezed] * problem.num_layers, stash=True)
    assert problem.total_memory([kept] * problem.num_layers, stash=True) > budget
    problem = replace(problem, budget_bytes=budget)
    fits = [p for p in pareto_front(problem, chain_aware=True)
            if problem.total_memory([list(p.picks)] * problem.num_layers, stash=True) <= budget]
    want = brute_force.solve(problem, chain_aware=True)
    assert want.layer_picks[0] == squeezed
    assert problem.num_layers * min(p.time_s for p in fits) == pytest.approx(want.predicted_time_s, rel=1e-9)
