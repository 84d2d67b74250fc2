"""The Megatron-LM tier's scheduler (``e2e.run_matrix``): cases side by side within the machine's ranks, cases
sharing a profile database one after the other in order, results in the order the cases were named."""

import threading
import time

import pytest

from megatron_adacc.testing import e2e


@pytest.fixture
def traced(monkeypatch):
    """``run_case`` replaced by a 50 ms sleep that records when each case ran and how many ranks ran beside it."""
    lock = threading.Lock()
    state = {"ranks": 0, "most": 0, "spans": {}, "saves": {}}

    def fake_run_case(c, launcher, workdir, *, extra=(), timeout=600, save_at=None):
        with lock:
            state["saves"][c.name] = save_at
            state["ranks"] += c.nproc
            state["most"] = max(state["most"], state["ranks"])
            start = time.perf_counter()
        time.sleep(0.05)
        with lock:
            state["ranks"] -= c.nproc
            state["spans"][c.name] = (start, time.perf_counter())
        return e2e.Run(c, 0, 0.05)

    monkeypatch.setattr(e2e, "run_case", fake_run_case)
    monkeypatch.setattr(e2e, "auto_budget_flags", lambda c, launcher, workdir: [])
    return state


def _matrix(names, slots):
    return e2e.run_matrix([e2e.case(n) for n in names], launcher=None, workdir=None, log=lambda _: None,
                          slots=slots)


def test_one_rank_cases_run_two_at_a_time_and_come_back_in_order(traced):
    names = ["none", "keep", "recompute", "gact", "adama", "stock-sdpa"]
    runs = _matrix(names, slots=2)
    assert list(runs) == ["stock", *names[:3], "gact", "adama", "stock-sdpa"]  # references first
    assert traced["most"] == 2  # two ran at once


def test_never_more_ranks_than_slots(traced):
    _matrix(["none-dp2", "recompute-tp2", "keep", "recompute"], slots=2)
    assert traced["most"] == 2
    traced["most"] = 0
    _matrix(["none", "keep"], slots=1)
    assert traced["most"] == 1


def test_cases_sharing_a_profile_database_run_in_order(traced):
    # auto-warm reads what auto-cold profiled; auto-cold's budget probe is auto-int4's, on the default database
    _matrix(["auto-int4", "auto-cold", "auto-warm", "auto-int4-resume", "stock-sdpa"], slots=2)
    spans = traced["spans"]
    for first, then in [("auto-int4", "auto-cold"), ("auto-cold", "auto-warm"), ("auto-int4", "auto-int4-resume"),
                        ("auto-cold", "auto-int4-resume")]:
        assert spans[first][1] <= spans[then][0], (first, then)
    assert e2e._databases(e2e.case("stock")) == frozenset()
    assert e2e._databases(e2e.case("auto-cold")) == {"cold", "profile"}


def test_a_resumed_case_starts_from_its_reference_s_checkpoint_once_the_reference_has_run(traced):
    """The reference saves where its resumed case loads (one launch for the resumed case, not two), and the
    resumed case waits for it even where the slots would let both run at once."""
    _matrix(["gact-resume", "adama-do-dp2-resume", "keep"], slots=4)
    spans, saves = traced["spans"], traced["saves"]
    assert saves == {"gact": 5, "gact-resume": None, "adama-do-dp2": 3, "adama-do-dp2-resume": None, "stock": None,
                     "keep": None}
    for reference, resumed in [("gact", "gact-resume"), ("adama-do-dp2", "adama-do-dp2-resume")]:
        assert spans[reference][1] <= spans[resumed][0], (reference, resumed)


def test_the_resume_point_is_the_reference_s_checkpoint_at_that_iteration(tmp_path):
    c = e2e.case("gact-resume")
    assert e2e.resume_point(c, tmp_path) is None  # the reference saved nothing: the case fails, saying so
    for it in (5, 10):
        saved = tmp_path / "gact.checkpoints" / f"iter_{it:07d}" / "megatron_adacc"
        saved.mkdir(parents=True)
        (saved / "rank00000.pt").write_bytes(b"%d" % it)
    (tmp_path / "gact.checkpoints" / "latest_checkpointed_iteration.txt").write_text("10")
    folder = e2e.resume_point(c, tmp_path)
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    assert (folder / "iter_0000005" / "megatron_adacc" / "rank00000.pt").read_bytes() == b"5"
