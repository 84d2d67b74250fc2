"""The solver with the MLP re-run in token tiles (:func:`~megatron_adacc.adacc.policy.cost_model.tile_mlp`): the
strategies find brute force's optimum on a tiled problem, the floor drops below the untiled one where the
MLP's activations outweigh its weights, and ``solve_policy`` tiles only where nothing untiled fits or a tiled
policy is faster (untiled, gradients stay stock Megatron's bit for bit). The measured side, a tiled policy's
per-stage peaks against this bound, is tests/runtime/test_backward_stages.py."""

from __future__ import annotations

import pytest

from megatron_adacc.adacc.policy.cost_model import build_problem, tile_mlp
from megatron_adacc.adacc.policy.ops import TILED_OPS
from megatron_adacc.adacc.policy.policy import Decision
from megatron_adacc.adacc.policy.profile import analytic_profile, mlp_weight_bytes
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, evaluate_policy, solve_policy
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError, brute_force, chain_aware, paper

# 2,048 tokens per micro-batch against a hidden size of 256: the MLP's activations are 8x its weights
SIG = plain_signature(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, seq_length=128,
                      micro_batch_size=16, dtype="float32", num_layers=12, megatron_core_version="0.16.1")
PROFILE = analytic_profile(SIG)
TILES = 8


def _tiled(problem):
    return tile_mlp(problem, TILES, mlp_weight_bytes(SIG))


def _tiles(policy) -> set[int]:
    return {d.tiles for layer in policy.layers for d in layer}


@pytest.mark.parametrize("frac", [0.0, 0.4])
def test_the_strategies_equal_brute_force_on_a_tiled_problem(frac: float) -> None:
    """As tests/policy/test_milp.py's checkpoint case: few enough policies to enumerate (the MLP's three ops have
    the tiled re-run as their one choice)."""
    def allow(op: str, d: Decision) -> bool:
        if op in ("scores", "softmax", "dropout"):
            return d.action == "recompute"
        return d.action != "compress" or op == "layer_input"

    probe = _tiled(build_problem(PROFILE, None, allow=allow))
    assert all(len(probe.choices[probe.op_names.index(name)]) == 1 for name in TILED_OPS)
    lo = probe.min_feasible_budget(stash=True)
    hi = probe.total_memory([[0] * probe.num_ops] * probe.num_layers, stash=True)
    problem = _tiled(build_problem(PROFILE, lo + frac * (hi - lo), allow=allow))
    for strategy, chain in ((paper, False), (chain_aware, True)):
        if not chain and frac == 0.0:
            continue  # the paper's memory model does not count segment inputs: its least budget differs
        got, want = strategy.solve(problem), brute_force.solve(problem, chain_aware=chain)
        assert got.predicted_time_s == pytest.approx(want.predicted_time_s, rel=1e-6, abs=1e-9)
        assert got.predicted_memory_bytes <= problem.budget_bytes


def test_tiles_lower_the_floor_where_the_mlp_s_activations_outweigh_its_weights() -> None:
    untiled = build_problem(PROFILE, None)
    tiled = _tiled(untiled)
    for heterogeneous in (False, True):
        assert tiled.min_feasible_budget(stash=True, heterogeneous=heterogeneous) < untiled.min_feasible_budget(
            stash=True, heterogeneous=heterogeneous)
    # at two micro-batches the weights' gradients, held twice while the block runs, outweigh what tiles save
    small = analytic_profile({**SIG, "micro_batch_size": 2})
    few = build_problem(small, None)
    assert tile_mlp(few, TILES, mlp_weight_bytes(SIG)).min_feasible_budget(stash=True) > few.min_feasible_budget(
        stash=True)


def _floors() -> tuple[int, int]:
    untiled = build_problem(PROFILE, None)
    return (untiled.min_feasible_budget(stash=True, heterogeneous=True),
            _tiled(untiled).min_feasible_budget(stash=True, heterogeneous=True))


def test_solve_policy_tiles_only_below_the_untiled_floor_and_never_when_lossless() -> None:
    untiled_floor, tiled_floor = _floors()
    between = (untiled_floor + tiled_floor) / 2
    options = SolveOptions(headroom=0.0, mlp_tiles=TILES)
    policy, _ = solve_policy(PROFILE, between, options)
    assert _tiles(policy) == {1, TILES}  # the MLP's three ops tiled, the other ops not
    assert policy.predicted["memory_bytes"] <= between
    evaluated = evaluate_policy(PROFILE, policy)
    assert evaluated["memory_bytes"] == pytest.approx(policy.predicted["memory_bytes"], abs=1)
    assert evaluated["time_s"] == pytest.approx(policy.predicted["time_s"])

    with pytest.raises(InfeasibleBudgetError) as untiled:
        solve_policy(PROFILE, between, SolveOptions(headroom=0.0, mlp_tiles=1))
    assert untiled.value.min_feasible_bytes == untiled_floor
    with pytest.raises(InfeasibleBudgetError) as tiled:
        solve_policy(PROFILE, tiled_floor - 1, options)
    assert tiled.value.min_feasible_bytes == tiled_floor  # the least of both is named

    roomy, _ = solve_policy(PROFILE, None, options)
    assert _tiles(roomy) == {1}
    with pytest.raises(InfeasibleBudgetError):  # --adacc-codec none promises bit-exact gradients
        solve_policy(PROFILE, between, SolveOptions(headroom=0.0, mlp_tiles=TILES, codec_family="none"))


def test_a_policy_that_tiles_some_layers_and_not_others_is_refused_by_the_evaluator() -> None:
    untiled_floor, tiled_floor = _floors()
    policy, _ = solve_policy(PROFILE, (untiled_floor + tiled_floor) / 2, SolveOptions(headroom=0.0))
    policy.layers[0] = list(build_problem(PROFILE, None).decisions([0] * len(policy.layers[0])))
    with pytest.raises(ValueError, match="re-run their MLP alike"):
        evaluate_policy(PROFILE, policy)


def test_each_tile_beyond_the_first_costs_the_profiled_overhead() -> None:
    """A tiled re-run's time is the untiled segment's plus the profile's ``tile_overhead_s`` per further tile
    (each tile's calls and autograd pass: llama-tiny measured 0.9 ms a tile, which made its tiled policies
    34% slower than predicted). The choice the solver sees carries it, and so do the policy's predicted time
    and its evaluation."""
    from dataclasses import replace

    from megatron_adacc.adacc.policy.cost_model import tiled_block_time

    per_tile = 1e-3
    untiled = build_problem(PROFILE, None)
    dear_profile = replace(PROFILE, tile_overhead_s=per_tile)
    dear = build_problem(dear_profile, None)
    assert tiled_block_time(dear, TILES) == pytest.approx(tiled_block_time(untiled, TILES) + (TILES - 1) * per_tile)
    assert tiled_block_time(dear, 1) == tiled_block_time(untiled, 1)
    last = dear.op_names.index(TILED_OPS[-1])
    assert _tiled(dear).choices[last][0].time_s == pytest.approx(tiled_block_time(dear, TILES))

    untiled_floor, tiled_floor = _floors()
    between = (untiled_floor + tiled_floor) / 2  # only a tiled policy fits
    options = SolveOptions(headroom=0.0, mlp_tiles=TILES)
    cheap, _ = solve_policy(PROFILE, between, options)
    costly, _ = solve_policy(dear_profile, between, options)
    assert _tiles(costly) == {1, TILES} and costly.same_decisions(cheap)
    extra = SIG["num_layers"] * (TILES - 1) * per_tile
    assert costly.predicted["time_s"] == pytest.approx(cheap.predicted["time_s"] + extra)
    assert evaluate_policy(dear_profile, costly)["time_s"] == pytest.approx(costly.predicted["time_s"])
