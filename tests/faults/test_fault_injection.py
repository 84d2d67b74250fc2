"""Issue 22 in CI: one bad input of each class through the real ``adacc`` command, refused in one line.

The cases are the ``ci`` rows of fault_cases.py, the table scripts/fault_sweep.py runs in full; fault_runner.py
judges each outcome the same way for both (exit status, one line naming the fault, no traceback, no file
written outside the paths flags name).
"""

from __future__ import annotations

import os

import pytest
from fault_cases import SMALL, all_cases, ci_cases
from fault_runner import Shared, child_env, cli, run_case

#: The cheapest refusal there is (argument checks, before any model): for the boundary's own tests.
REFUSED = ["train", *SMALL, "--micro-batch-size", "0"]


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Shared:
    """One checkpoint for the run: xdist's workers have folders of their own in one base folder."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fault-cases-shared"
    root.mkdir(exist_ok=True)
    return Shared(root)


@pytest.mark.parametrize("case", ci_cases(), ids=lambda case: case.name)
def test_a_bad_input_is_refused_in_one_line(case, shared, tmp_path):
    outcome = run_case(case, tmp_path / "sandbox", shared)
    assert not outcome.problems(), f"{outcome.problems()}\n{outcome.stderr[-3000:]}"


def test_every_class_of_the_sweep_has_a_representative_here():
    assert {case.kind for case in ci_cases()} == {case.kind for case in all_cases()}


@pytest.mark.parametrize("where", ["before", "after", "environment"])
def test_debug_shows_the_traceback_instead(tmp_path, where):
    argv = {"before": ["--debug", *REFUSED], "after": [*REFUSED, "--debug"], "environment": REFUSED}[where]
    env = child_env(tmp_path, {"ADACC_DEBUG": "1"} if where == "environment" else {})
    out = cli(argv, tmp_path, env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("Traceback") and "IntegrationError: --micro-batch-size 0" in out.stderr


def test_under_torchrun_only_rank_0_says_it(tmp_path):
    ranks = {rank: cli(REFUSED, tmp_path, child_env(tmp_path, {"RANK": rank})) for rank in ("0", "1")}
    assert [out.returncode for out in ranks.values()] == [2, 2]
    assert ranks["0"].stderr.startswith("adacc: --micro-batch-size 0") and ranks["1"].stderr == ""


def test_a_refusal_one_rank_may_meet_alone_is_said_by_every_rank(capsys, monkeypatch):
    """A stopped rank 0 cannot speak for the others: a rank timeout is told by whichever ranks meet it."""
    from megatron_adacc.core.errors import EXIT_REFUSED, AdaccError, refusal_boundary
    from megatron_adacc.training.distributed import RankTimeout

    def fails(error):
        def command(argv):
            raise error
        return command

    monkeypatch.setenv("RANK", "1")
    assert refusal_boundary(fails(RankTimeout("rank 0 of 2 did not answer")), []) == EXIT_REFUSED
    assert capsys.readouterr().err == "adacc: rank 1: rank 0 of 2 did not answer\n"
    assert refusal_boundary(fails(AdaccError("the same on every rank")), []) == EXIT_REFUSED
    assert capsys.readouterr().err == ""
