"""Profiles one can trust (issue 22, Deliver 7): timings repeated until their runs agree, and a profile whose
timings would not is flagged, said so when stored and at every reuse, and replaced by ``adacc profile --refresh``."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_adacc.adacc.integration import profiler
from megatron_adacc.adacc.policy.profile import analytic_profile


def _clock(durations: list[float]):
    """A ``perf_counter`` under which the n-th timed run of ``_timed`` lasts ``durations[n]`` (the last repeats)."""
    state = {"now": 0.0, "calls": 0}

    def perf_counter() -> float:
        run, end = divmod(state["calls"], 2)
        state["calls"] += 1
        if end:
            state["now"] += durations[min(run, len(durations) - 1)]
        return state["now"]

    return perf_counter, state


def _timed(monkeypatch, durations: list[float], repeats: int = 3) -> tuple[float, int, profiler.TimingNoise]:
    clock, state = _clock(durations)
    monkeypatch.setattr(profiler.time, "perf_counter", clock)
    noise = profiler.TimingNoise()
    profiler._NOISE.append(noise)
    try:
        median = profiler._timed(lambda: None, repeats, lambda: None)
    finally:
        profiler._NOISE.pop()
    return median, state["calls"] // 2, noise


def test_runs_that_agree_are_timed_repeats_times(monkeypatch):
    assert _timed(monkeypatch, [1.0, 1.1, 0.95]) == (1.0, 3, profiler.TimingNoise(1, 0, 0))


def test_a_run_slowed_by_a_neighbour_is_outvoted_by_more_runs(monkeypatch):
    median, runs, noise = _timed(monkeypatch, [1.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    assert (median, runs) == (1.0, 6) and noise.unstable == 0 and noise.extra_runs == 3


def test_runs_that_never_agree_stop_at_the_cap_and_count_as_unstable(monkeypatch):
    median, runs, noise = _timed(monkeypatch, [1.0, 3.0] * 50)
    assert runs == max(3 * profiler.MAX_REPEAT_FACTOR, profiler.MIN_UNSTABLE_RUNS) and noise.unstable == 1
    assert median == 2.0


def _analytic():
    return dataclasses.replace(_ANALYTIC, meta={})


_ANALYTIC = analytic_profile(dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                              micro_batch_size=2, dtype="float32", num_layers=2, vocab_size=256))


@pytest.mark.parametrize("unstable, flagged", [(0, False), (1, False), (3, True)])
def test_a_profile_with_many_unstable_timings_is_flagged_and_says_so(monkeypatch, caplog, unstable, flagged):
    def measured(*args, **kwargs):
        for i in range(10):  # ten measurements, the first `unstable` of them never agreeing
            monkeypatch.setattr(profiler.time, "perf_counter", _clock([1.0, 3.0] * 50 if i < unstable else [1.0])[0])
            profiler._timed(lambda: None, 3, lambda: None)
        return _analytic()

    monkeypatch.setattr(profiler, "_profile_layer", measured)
    monkeypatch.setattr(profiler, "load_per_core", lambda: 0.5)  # a quiet machine, whatever this one's load
    with caplog.at_level("WARNING", logger="megatron_adacc"):
        profile = profiler.profile_layer(None, None, None)
    logs = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert profile.meta["timing"]["measurements"] == 10 and profile.meta["timing"]["unstable"] == unstable
    assert ("contended" in profile.meta) is flagged
    assert any("measured under contention" in m and "adacc profile --refresh" in m for m in logs) is flagged
    assert not profiler._NOISE


def test_two_profilers_side_by_side_are_flagged_by_the_load(monkeypatch):
    """They time each other's work consistently: no spread shows it, the machine's load does."""
    monkeypatch.setattr(profiler, "_profile_layer", lambda *a, **k: dataclasses.replace(_ANALYTIC, meta={},
                                                                                          device="cpu:test x2"))
    monkeypatch.setattr(profiler, "load_per_core", lambda: 2.1)
    profile = profiler.profile_layer(None, None, None)
    assert profile.meta["contended"] == "the load average was 2.1 per core"
    assert profile.meta["timing"]["load_per_core"] == 2.1
