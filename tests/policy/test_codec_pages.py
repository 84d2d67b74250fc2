"""What a compressing policy's process holds beyond a keep-everything one's (``SolveOptions.codec_pages_bytes``: on
the CPU, the codecs' kernel pages and the heap their small tensors grow) is charged to compressing policies only:
the solver weighs the best of them, charged, against the best policy that compresses nothing, and takes the
faster. The calibration that measures it: tests/foundation/test_budget_user_path.py."""

from __future__ import annotations

import pytest

from megatron_adacc.adacc.policy.ops import Action
from megatron_adacc.adacc.policy.profile import analytic_profile
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, make_problem, solve_policy

SIG = plain_signature(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, seq_length=128,
                      micro_batch_size=4, dtype="float32", num_layers=6, megatron_core_version="0.16.1")
PROFILE = analytic_profile(SIG)


def _compresses(policy) -> bool:
    return any(d.action == Action.COMPRESS for layer in policy.layers for d in layer)


def _budget_where_compressing_wins(options: SolveOptions) -> float:
    """A budget at which the best policy (no pages charged) compresses."""
    problem = make_problem(PROFILE, None, options)
    lo = problem.min_feasible_budget(stash=True)
    hi = problem.total_memory([problem.stock_picks()] * problem.num_layers, stash=True)
    for frac in (0.3, 0.5, 0.7, 0.1):
        budget = lo + frac * (hi - lo)
        if _compresses(solve_policy(PROFILE, budget, options)[0]):
            return budget
    raise AssertionError("no budget of this profile has a compressing best policy")


@pytest.mark.parametrize("tiles", [1, 8])
def test_pages_are_charged_to_compressing_policies_only(tiles: int) -> None:
    free = SolveOptions(headroom=0.0, mlp_tiles=tiles)
    budget = _budget_where_compressing_wins(free)
    lossless, _ = solve_policy(PROFILE, budget, SolveOptions(headroom=0.0, mlp_tiles=tiles, codec_family="none"))
    compressing, result = solve_policy(PROFILE, budget, free)
    gain = lossless.predicted["time_s"] - result.predicted_time_s
    assert gain > 0
    # a little: still the compressing policy, its prediction and static memory carrying the pages
    few = 1024.0
    charged, charged_result = solve_policy(PROFILE, budget + few, SolveOptions(headroom=0.0, mlp_tiles=tiles,
                                                                               codec_pages_bytes=few))
    assert _compresses(charged)
    assert charged.predicted["static_bytes"] == compressing.predicted["static_bytes"] + few
    assert charged_result.predicted_memory_bytes <= budget + few
    # more than the budget leaves beside any compressing policy: the best lossless one, uncharged
    huge = float(budget)
    uncharged, _ = solve_policy(PROFILE, budget, SolveOptions(headroom=0.0, mlp_tiles=tiles, codec_pages_bytes=huge))
    assert not _compresses(uncharged)
    assert uncharged.layers == lossless.layers
    assert uncharged.predicted["static_bytes"] == lossless.predicted["static_bytes"]


def test_the_faster_of_the_two_is_taken() -> None:
    """With the pages charged, the answer is the faster of the best compressing policy (solved with the pages in
    its static memory) and the best lossless one."""
    free = SolveOptions(headroom=0.0, mlp_tiles=1)
    budget = _budget_where_compressing_wins(free)
    for pages in (0.0, 2.0**16, 2.0**20, 2.0**22, 2.0**24):
        options = SolveOptions(headroom=0.0, mlp_tiles=1, codec_pages_bytes=pages)
        _, got = solve_policy(PROFILE, budget, options)
        candidates = []
        for family, extra in (("int4", pages), ("none", 0.0)):
            try:
                candidates.append(solve_policy(PROFILE, budget - extra, SolveOptions(
                    headroom=0.0, mlp_tiles=1, codec_family=family))[1].predicted_time_s)
            except Exception:  # noqa: BLE001 - nothing of that kind fits
                pass
        assert got.predicted_time_s == pytest.approx(min(candidates), rel=1e-9)


def test_a_lossless_run_is_never_charged() -> None:
    options = SolveOptions(headroom=0.0, codec_family="none", codec_pages_bytes=2.0**30)
    problem = make_problem(PROFILE, None, options)
    assert problem.static_bytes == make_problem(PROFILE, None, SolveOptions(codec_family="none")).static_bytes
