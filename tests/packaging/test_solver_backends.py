"""The MILP backend is chosen at run time from what the install has: HiGHS (highspy) first, CBC where PuLP has
one, a one-line refusal naming the install command when neither; every installed backend solves to the same
optimum as exhaustive search."""

from __future__ import annotations

import random
import subprocess
import sys

import pulp
import pytest

from megatron_adacc.adacc.policy.cost_model import Choice, Problem
from megatron_adacc.adacc.policy.policy import Decision
from megatron_adacc.adacc.policy.strategies import brute_force, chain_aware, heterogeneous, paper
from megatron_adacc.adacc.policy.strategies.base import (
    BACKENDS,
    SOLVER_ENV,
    SolverUnavailable,
    available_backends,
    milp_backend,
    milp_solver,
    select_backend,
)
from megatron_adacc.core.errors import AdaccError


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv(SOLVER_ENV, raising=False)


def small_problem(seed: int, frac: float) -> Problem:
    """Four ops with keep / INT4 / recompute choices, three layers, a budget ``frac`` of the way from the least
    feasible to keep-everything (the shape of tests/policy/test_milp.py's instances, small enough to enumerate)."""
    rng = random.Random(seed)
    choices = []
    for i in range(4):
        m = float(rng.randint(1, 100))
        cs = [Choice(Decision.keep(), m, 0.0), Choice(Decision.compress("int4_symmetric"), m * rng.uniform(0.1, 0.5),
                                                      rng.uniform(0.1, 2.0), (rng.uniform(0.05, 1.0),))]
        if i:
            cs.append(Choice(Decision.recompute(), 0.0, rng.uniform(0.1, 5.0)))
        choices.append(cs)
    problem = Problem(choices=choices, num_layers=3, static_bytes=10.0, budget_bytes=None,
                      segment_time=lambda a, b: 0.3 * (b - a + 1))
    lo = problem.min_feasible_budget(stash=True)
    problem.budget_bytes = lo + frac * (problem.total_memory([[0] * 4] * 3, stash=True) - lo)
    return problem


def installed(backend: str):
    return pytest.param(backend, marks=pytest.mark.skipif(backend not in available_backends(),
                                                          reason=f"{backend} is not installed here"))


def test_some_backend_is_installed_and_auto_prefers_highs():
    """The package depends on highspy, so HiGHS is there wherever it installs (CBC only with PuLP < 4)."""
    assert "highs" in available_backends()
    assert select_backend() == "highs"


@pytest.mark.parametrize("backend", [installed(b) for b in BACKENDS])
@pytest.mark.parametrize("seed", range(6))
def test_every_installed_backend_finds_the_exhaustive_optimum(backend: str, seed: int):
    for frac in (0.1, 0.5, 0.9):
        problem = small_problem(seed, frac)
        with milp_backend(backend):
            for strategy, chain, solved_by in ((paper, False, backend), (chain_aware, True, None)):
                got = strategy.solve(problem)
                best = brute_force.solve(problem, chain_aware=chain)
                assert got.backend == solved_by and got.status == "Optimal"  # chain-aware: the Pareto DP, no MILP
                assert got.predicted_time_s == pytest.approx(best.predicted_time_s, abs=1e-12), (strategy.NAME, frac)
            mixed = heterogeneous.solve(problem, chain_aware=True, time_limit_s=None)
            assert mixed.predicted_time_s <= brute_force.solve(problem, chain_aware=True).predicted_time_s + 1e-12


def test_the_policy_file_names_the_backend_that_solved_it(tmp_path):
    from megatron_adacc.adacc.policy.io import load_policy, save_policy
    from megatron_adacc.adacc.policy.profile import analytic_profile
    from megatron_adacc.adacc.policy.signature import plain_signature
    from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy

    profile = analytic_profile(plain_signature(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
                                               seq_length=128, micro_batch_size=2, dtype="float32", num_layers=4,
                                               megatron_core_version="0.16.1"))
    for backend in available_backends():
        with milp_backend(backend):
            policy, result = solve_policy(profile, 2**40, SolveOptions(headroom=0.0))
        assert result.backend == backend
        assert load_policy(save_policy(policy, tmp_path / f"{backend}.json")).solver["backend"] == backend
    assert brute_force.solve(small_problem(0, 0.5), chain_aware=True).backend is None


def test_highs_runs_to_a_proven_optimum_like_cbc():
    """HiGHS stops at a 1e-4 relative gap by default; CBC proves optimality. Both are asked for gap 0."""
    solver = milp_solver("highs", time_limit_s=0.5)
    assert solver.gapRel == 0.0 and solver.timeLimit == 0.5 and solver.msg is False


def test_the_environment_forces_a_backend_and_a_block_overrides_it(monkeypatch):
    for backend in available_backends():
        monkeypatch.setenv(SOLVER_ENV, backend.upper())
        assert select_backend() == backend
    monkeypatch.setenv(SOLVER_ENV, "highs")
    with milp_backend(available_backends()[-1]) as chosen:
        assert select_backend() == chosen
    assert select_backend() == "highs"


def test_an_unknown_backend_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(SOLVER_ENV, "glpk")
    with pytest.raises(SolverUnavailable, match=r"ADACC_MILP_SOLVER='glpk' is not a MILP backend: use one of highs"):
        select_backend()


def test_without_highspy_auto_falls_back_to_cbc_and_a_forced_highs_names_pip_install_highspy(monkeypatch):
    monkeypatch.delattr(pulp, "HiGHS")
    if "cbc" in available_backends():
        assert select_backend() == "cbc"
    monkeypatch.setenv(SOLVER_ENV, "highs")
    with pytest.raises(SolverUnavailable, match=r"highs is not installed .*: pip install highspy") as err:
        paper.solve(small_problem(0, 0.5))
    assert isinstance(err.value, AdaccError) and "\n" not in str(err.value)


def test_bench_budget_reports_every_backends_solve_time(capsys):
    from megatron_adacc.bench.budget import _milp

    out = _milp(small_problem(1, 0.5))
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[-len(available_backends()):] == available_backends()
    for label, backends in (("paper", available_backends()), ("chain_aware", available_backends()[:1]),
                            ("heterogeneous+chain_aware", available_backends())):
        times = out[label]["solve_time_s_by_backend"]  # the chain-aware DP runs no MILP: solved once
        assert list(times) == backends and all(t > 0 for t in times.values())
        assert any(line.startswith(label + " ") for line in table)


def test_highs_prints_no_banner():
    """HiGHS writes a copyright banner to the C stdout when a process makes its first solver; an `adacc solve`
    would show it above the policy table."""
    code = ("from megatron_adacc.adacc.policy.strategies import paper\n"
            "from megatron_adacc.adacc.policy.strategies.base import milp_backend\n"
            f"from {__name__} import small_problem\n"
            "with milp_backend('highs'):\n"
            "    print(paper.solve(small_problem(0, 0.5)).backend)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).parent))
    assert run.returncode == 0, run.stderr
    assert run.stdout == "highs\n"
