"""Adaptive policy evolution on synthetic outlier statistics."""

from __future__ import annotations

import itertools

import pytest

from megatron_adacc.adacc.integration.evolution import PolicyEvolution, tracking_iterations
from megatron_adacc.adacc.policy.ops import OUTLIER_CODEC
from megatron_adacc.adacc.policy.profile import analytic_profile
from megatron_adacc.adacc.policy.solver import SolveOptions, evaluate_policy, make_problem, solve_policy

SIG = dict(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, seq_length=256, micro_batch_size=2,
           dtype="float32", num_layers=8, megatron_core_version="0.16.1")


class DriftingOutliers:
    """Reports the compressed bytes the runtime would measure for the current policy's int4_outlier ops:
    the original profile's sizes times ``factor(iteration)``."""

    def __init__(self, profile, factor):
        self.profile, self.factor, self.iteration = profile, factor, 0
        self.calls = []

    def measure(self, policy):
        self.calls.append(self.iteration)
        out = {}
        for op, d in policy.layer_decisions(0).items():
            if d.action == "compress" and d.codec == OUTLIER_CODEC:
                out[op] = self.profile.op(op).codecs[OUTLIER_CODEC].compressed_bytes * self.factor(self.iteration)
        return out


def setup(factor, frac=0.2):
    # many outliers at first: outlier-separated INT4 barely beats recompute on memory
    profile = analytic_profile(SIG, outlier_fraction=0.25, codec_bytes_per_s=2e10)
    probe = make_problem(profile, None, SolveOptions())
    lo = probe.min_feasible_budget(stash=True)
    hi = probe.fixed_bytes + SIG["num_layers"] * sum(cs[0].memory_bytes for cs in probe.choices)
    budget = lo + frac * (hi - lo)
    policy, _ = solve_policy(profile, budget)
    source = DriftingOutliers(profile, factor)
    applied = []
    evo = PolicyEvolution(profile=profile, policy=policy, budget_bytes=budget, source=source,
                          apply=applied.append, cap=8, log=lambda m: None)
    return evo, source, applied, policy


def run(evo, source, iterations):
    for it in range(1, iterations + 1):
        source.iteration = it
        evo.on_step_end(it, loss=1.0)


def test_schedule_is_exponential_backoff_up_to_the_cap() -> None:
    assert list(itertools.islice(tracking_iterations(8), 9)) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert list(itertools.islice(tracking_iterations(1), 4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="cap"):
        next(tracking_iterations(0))


def test_stable_stream_never_switches() -> None:
    evo, source, applied, policy = setup(lambda it: 1.0)
    assert any(d.codec == OUTLIER_CODEC for d in policy.layers[0]), "the setup must compress some outlier op"
    run(evo, source, 40)
    assert source.calls == [1, 2, 4, 8, 16, 24, 32, 40]
    assert evo.switches == [] and applied == []
    assert evo.policy is policy
    assert all(not r.switched for r in evo.tracks)


def test_outliers_dropping_switches_to_a_faster_policy_once() -> None:
    evo, source, applied, policy = setup(lambda it: 1.0 if it < 6 else 0.3)
    before = evaluate_policy(evo.profile, policy)
    run(evo, source, 40)
    assert len(evo.switches) == 1, [(r.iteration, r.reason) for r in evo.tracks]
    sw = evo.switches[0]
    assert sw.iteration == 8  # the first tracking iteration after the drift at 6
    assert sw.reason == "predicted faster"
    assert applied == [evo.policy] and evo.policy is not policy
    after = evaluate_policy(evo.profile, evo.policy)
    assert after["time_s"] < sw.current_time_s <= before["time_s"] + 1e-12
    assert after["memory_bytes"] <= evo.budget_bytes
    # the profile now carries the measured (smaller) sizes
    op = next(op for op, d in policy.layer_decisions(0).items() if d.codec == OUTLIER_CODEC)
    assert evo.profile.op(op).codecs[OUTLIER_CODEC].compressed_bytes < \
        policy_profile_bytes(op)


def policy_profile_bytes(op):
    profile = analytic_profile(SIG, outlier_fraction=0.25, codec_bytes_per_s=2e10)
    return profile.op(op).codecs[OUTLIER_CODEC].compressed_bytes


def test_outliers_growing_past_the_budget_forces_a_switch() -> None:
    evo, source, applied, policy = setup(lambda it: 1.0 if it < 3 else 3.0)
    run(evo, source, 4)
    assert [r.iteration for r in evo.switches] == [4]
    assert evo.switches[0].reason == "current policy no longer fits the budget"
    assert evo.switches[0].current_memory_bytes > evo.budget_bytes
    assert evaluate_policy(evo.profile, evo.policy)["memory_bytes"] <= evo.budget_bytes


def test_no_evolution_flag_disables_it() -> None:
    from types import SimpleNamespace

    from megatron_adacc.adacc.integration.evolution import build_extension

    _, _, _, policy = setup(lambda it: 1.0)
    assert build_extension(SimpleNamespace(adacc_no_evolution=True), None, policy) is None


def test_a_policy_file_names_what_to_read_never_where_to_write(tmp_path, capsys) -> None:
    """A policy file's ``profile.db`` used to make training create folders and an SQLite file at that path (it
    turned an existing empty user file into a database). Now it is read when it is a profile database, and
    otherwise evolution is off, with a note, and nothing is touched."""
    from types import SimpleNamespace

    from megatron_adacc.adacc.integration.evolution import build_extension
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    _, _, _, policy = setup(lambda it: 1.0)
    args = SimpleNamespace(adacc_no_evolution=False)
    user_file = tmp_path / "notes.txt"
    user_file.write_bytes(b"")
    for target in (tmp_path / "new" / "folder" / "profile.sqlite", user_file, tmp_path):
        policy.profile = {"db": str(target), "id": 1}
        assert build_extension(args, None, policy) is None
        assert "policy evolution is off" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and user_file.read_bytes() == b""

    db = ProfileDB(tmp_path / "real.sqlite")  # a real one is read
    policy.profile = {"db": str(db.path), "id": db.put(analytic_profile(SIG))}
    assert build_extension(args, None, policy) is not None
