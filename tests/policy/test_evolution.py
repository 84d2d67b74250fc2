"""Adaptive policy evolution on synthetic outlier statistics: every op offering outlier-separated INT4 is
sampled, whatever the policy does with it, so a recomputed op whose outliers fall can become compressed."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_adacc.adacc.integration.evolution import OutlierSeries, PolicyEvolution, resampled, tracking_iterations
from megatron_adacc.adacc.integration.outlier_probe import OUTLIER_OPS, OpSample
from megatron_adacc.adacc.policy.ops import OUTLIER_CODEC, Action
from megatron_adacc.adacc.policy.profile import CodecProfile, analytic_profile
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, evaluate_policy, make_problem, solve_policy
from megatron_adacc.codecs import get_codec

SIG = plain_signature(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, seq_length=256,
                      micro_batch_size=2, dtype="float32", num_layers=8, megatron_core_version="0.16.1")
#: The output shape of each outlier op ([s, b, h], or [s, b, ffn] for the MLP's up projection and activation).
SHAPES = {op: (SIG["seq_length"], SIG["micro_batch_size"],
               SIG["ffn_hidden_size"] if op in ("linear_fc1", "activation") else SIG["hidden_size"])
          for op in OUTLIER_OPS}
HIGH = 0.8  # outlier fraction at profile time: outlier-separated INT4 then barely beats keeping


class SampledOutliers:
    """What the probe would report: every outlier op's output with ``fraction(iteration)`` of its channels
    outliers, whatever the policy does with the op."""

    def __init__(self, fraction):
        self.fraction, self.iteration = fraction, 0
        self.armed, self.calls = [], []

    def setup(self, model) -> None:
        pass

    def arm(self) -> None:
        self.armed.append(self.iteration)

    def measure(self, policy):
        self.calls.append(self.iteration)
        f = self.fraction(self.iteration)
        return {op: OpSample(f * shape[-1], shape[-1], (shape,), torch.float32) for op, shape in SHAPES.items()}


def setup(fraction, high=HIGH, frac=0.2):
    profile = analytic_profile(SIG, outlier_fraction=high, codec_bytes_per_s=2e10)
    probe = make_problem(profile, None, SolveOptions())
    lo = probe.min_feasible_budget(stash=True)
    hi = probe.fixed_bytes + SIG["num_layers"] * sum(cs[0].memory_bytes for cs in probe.choices)
    budget = lo + frac * (hi - lo)
    policy, _ = solve_policy(profile, budget)
    source = SampledOutliers(fraction)
    applied = []
    evo = PolicyEvolution(profile=profile, policy=policy, budget_bytes=budget, source=source,
                          apply=applied.append, cap=8, log=lambda m: None)
    return evo, source, applied, policy


def run(evo, source, iterations):
    for it in range(1, iterations + 1):
        source.iteration = it
        evo.on_step_begin(it)
        evo.on_step_end(it, loss=1.0)


def recomputed_everywhere(policy) -> set[str]:
    return {op for op in OUTLIER_OPS
            if all(policy.layer_decisions(i)[op].action == Action.RECOMPUTE for i in range(policy.num_layers))}


def test_schedule_is_exponential_backoff_up_to_the_cap() -> None:
    assert list(itertools.islice(tracking_iterations(8), 9)) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert list(itertools.islice(tracking_iterations(1), 4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="cap"):
        next(tracking_iterations(0))


def test_outliers_staying_high_never_switch() -> None:
    evo, source, applied, policy = setup(lambda it: HIGH)
    assert recomputed_everywhere(policy), "the setup must recompute some op that offers int4_outlier"
    before = {op: evo.profile.op(op).codecs[OUTLIER_CODEC].compressed_bytes for op in OUTLIER_OPS}
    run(evo, source, 40)
    assert source.armed == source.calls == [1, 2, 4, 8, 16, 24, 32, 40]  # armed before, sampled after
    assert evo.switches == [] and applied == [] and evo.policy is policy
    assert all(not r.switched for r in evo.tracks)
    # the same count as profiled: the same bytes (up to the analytic formula's rounding)
    for op in OUTLIER_OPS:
        assert evo.profile.op(op).codecs[OUTLIER_CODEC].compressed_bytes == pytest.approx(before[op], rel=1e-6)


def test_falling_outliers_turn_a_recomputed_op_to_compression() -> None:
    evo, source, applied, policy = setup(lambda it: HIGH if it < 6 else 0.01)
    recomputed = recomputed_everywhere(policy)
    assert recomputed, "the setup must recompute some op that offers int4_outlier"
    before = evaluate_policy(evo.profile, policy)
    run(evo, source, 40)
    assert len(evo.switches) == 1, [(r.iteration, r.reason) for r in evo.tracks]
    sw = evo.switches[0]
    assert sw.iteration == 8  # the first tracking iteration after the drop at 6
    assert sw.reason == "predicted faster"
    assert applied == [evo.policy] and evo.policy is not policy
    after = evaluate_policy(evo.profile, evo.policy)
    assert after["time_s"] < sw.current_time_s <= before["time_s"] + 1e-12
    assert after["memory_bytes"] <= evo.budget_bytes
    now_compressed = {op for op in recomputed for i in range(evo.policy.num_layers)
                      if evo.policy.layer_decisions(i)[op].codec == OUTLIER_CODEC}
    assert now_compressed, f"no op of {sorted(recomputed)} became compressed with {OUTLIER_CODEC}"
    # the recomputed op was sampled all along: its profiled size fell by the codec's own size ratio
    op = sorted(recomputed)[0]
    codec, shape = get_codec(OUTLIER_CODEC), SHAPES[op]
    ratio = codec.compressed_nbytes(shape, torch.float32, num_outliers=round(0.01 * shape[-1])) / \
        codec.compressed_nbytes(shape, torch.float32, num_outliers=round(HIGH * shape[-1]))
    profiled = analytic_profile(SIG, outlier_fraction=HIGH, codec_bytes_per_s=2e10)
    assert evo.profile.op(op).codecs[OUTLIER_CODEC].compressed_bytes == pytest.approx(
        profiled.op(op).codecs[OUTLIER_CODEC].compressed_bytes * ratio, rel=0.01)


def test_outliers_growing_past_the_budget_forces_a_switch() -> None:
    evo, source, applied, policy = setup(lambda it: 0.25 if it < 3 else 1.0, high=0.25)
    assert any(d.codec == OUTLIER_CODEC for d in policy.layers[0]), "the setup must compress some outlier op"
    run(evo, source, 4)
    assert [r.iteration for r in evo.switches] == [4]
    assert evo.switches[0].reason == "current policy no longer fits the budget"
    assert evo.switches[0].current_memory_bytes > evo.budget_bytes
    assert evaluate_policy(evo.profile, evo.policy)["memory_bytes"] <= evo.budget_bytes


def test_a_sample_rescales_bytes_in_the_profiles_units_and_replaces_raw_codec_times() -> None:
    shape = (64, 2, 128)
    codec = get_codec(OUTLIER_CODEC)
    old = CodecProfile(5000, 1e-3, 2e-3, {"outlier_channels": 32, "channels": 128})
    sample = OpSample(8.0, 128, (shape,), torch.bfloat16, compress_time_s=4e-4, decompress_time_s=2.5e-3)
    new = resampled(old, sample, saved=True)
    want = 5000 * codec.compressed_nbytes(shape, torch.bfloat16, num_outliers=8) / \
        codec.compressed_nbytes(shape, torch.bfloat16, num_outliers=32)
    assert new.compressed_bytes == round(want)
    # raw times (the profile's calibration scale applies later); a change within timing noise keeps the profile's
    assert (new.compress_time_s, new.decompress_time_s) == (4e-4, 2e-3)
    assert new.stats == {"outlier_channels": 8.0, "channels": 128}
    # an op that saves nothing for backward keeps the profiled times (of its outputs, for a stash)
    kept = resampled(CodecProfile(0, 1e-3, 2e-3, {}), sample, saved=False)
    assert (kept.compress_time_s, kept.decompress_time_s) == (1e-3, 2e-3)
    # a profile without a count keeps its bytes: the first sample becomes the reference
    first = resampled(CodecProfile(5000, 1e-3, 2e-3, {}), sample, saved=True)
    assert first.compressed_bytes == 5000 and first.stats["outlier_channels"] == 8.0


def test_the_outlier_series_is_reported_and_kept_across_a_checkpoint() -> None:
    evo, source, _, _ = setup(lambda it: HIGH if it < 3 else 0.1)
    run(evo, source, 8)
    series = evo.report()["outlier_channels"]
    assert series["iterations"] == [1, 2, 4, 8]
    assert set(series["ops"]) == set(OUTLIER_OPS)
    assert series["ops"]["linear_fc1"] == [round(HIGH * 1024, 2)] * 2 + [102.4] * 2
    assert series["channels"]["linear_fc1"] == 1024
    resumed, _, _, _ = setup(lambda it: HIGH)
    resumed.load_state_dict(evo.state_dict())
    assert resumed.report()["outlier_channels"] == series
    assert OutlierSeries.from_json(series).to_json() == series


def test_no_evolution_flag_disables_it() -> None:
    from types import SimpleNamespace

    from megatron_adacc.adacc.integration.evolution import build_extension

    _, _, _, policy = setup(lambda it: 1.0)
    assert build_extension(SimpleNamespace(adacc_no_evolution=True), None, policy) is None


def test_a_policy_file_names_what_to_read_never_where_to_write(tmp_path, capsys, adacc_log) -> None:
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


def test_a_policy_file_evolves_against_the_process_memory_it_was_solved_with(tmp_path) -> None:
    """A file solved on the CPU for a budget that counts the process's memory: re-solved without it, evolution
    found everything fit and switched a 430 MiB run to keeping everything."""
    from types import SimpleNamespace

    from megatron_adacc.adacc.integration.evolution import build_extension
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    db = ProfileDB(tmp_path / "p.sqlite")
    profile = analytic_profile(SIG)
    pid = db.put(profile)
    baseline = 300 * 2**20
    policy, _ = solve_policy(profile, _tight(profile, baseline), SolveOptions(process_baseline_bytes=baseline))
    policy.profile = {"db": str(db.path), "id": pid}
    evo = build_extension(SimpleNamespace(adacc_no_evolution=False), None, policy)
    assert evo.options.process_baseline_bytes == baseline
    given = build_extension(SimpleNamespace(adacc_no_evolution=False, adacc_process_baseline_bytes=7.0), None, policy)
    assert given.options.process_baseline_bytes == 7.0  # the command line's own figure wins


def _tight(profile, baseline: float = 0.0) -> float:
    """A budget under which ``profile``'s policy compresses or recomputes (one keeping everything never evolves)."""
    return make_problem(profile, None, SolveOptions(process_baseline_bytes=baseline)).min_feasible_budget(
        stash=True) * 1.05


def test_a_policy_that_keeps_everything_starts_no_evolution(tmp_path, capsys, adacc_log) -> None:
    """No re-solve can better a policy that keeps everything (it costs nothing, and its memory does not depend
    on outliers), so its run tracks nothing: the probe would only cost time and, on the CPU, resident memory.
    A policy of the same profile that compresses or recomputes does evolve."""
    from types import SimpleNamespace

    from megatron_adacc.adacc.integration.evolution import build_extension
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    db = ProfileDB(tmp_path / "p.sqlite")
    ref = {"db": str(db.path), "id": db.put(analytic_profile(SIG))}
    args = SimpleNamespace(adacc_no_evolution=False)
    roomy, _ = solve_policy(analytic_profile(SIG), 2 * 2**30)
    assert {d.action for layer in roomy.layers for d in layer} == {Action.KEEP}
    roomy.profile = ref
    assert build_extension(args, None, roomy) is None
    assert "keeps everything" in capsys.readouterr().err
    tight, _ = solve_policy(analytic_profile(SIG), _tight(analytic_profile(SIG)))
    assert {d.action for layer in tight.layers for d in layer} != {Action.KEEP}
    tight.profile = ref
    assert build_extension(args, None, tight) is not None


def test_a_run_continuing_a_checkpoint_made_without_evolution_tracks_from_its_own_start() -> None:
    """Continuing a stock checkpoint of iteration 3000 under auto profiles anew: the drift to sample early is the
    one since then. The schedule counted from iteration 0 tracked first at 3072 (cap 1024: never, in a short
    run)."""
    evo, source, _, _ = setup(lambda it: HIGH)
    for it in range(3001, 3021):
        source.iteration = it
        evo.on_step_begin(it)
        evo.on_step_end(it, loss=1.0)
    assert [r.iteration for r in evo.tracks] == [3001, 3002, 3004, 3008, 3016]
    assert source.armed == [3001, 3002, 3004, 3008, 3016]


def test_a_resumed_evolution_tracks_where_the_straight_run_does() -> None:
    """Resumed at 3010 from a checkpoint of a run that started at 3001, evolution keeps that run's schedule, so a
    resumed run and a straight one sample, and switch, at the same iterations."""
    straight, source, _, _ = setup(lambda it: HIGH)
    for it in range(3001, 3021):
        source.iteration = it
        straight.on_step_begin(it)
        straight.on_step_end(it, loss=1.0)
        if it == 3010:
            state = straight.state_dict()
    resumed, source2, _, _ = setup(lambda it: HIGH)
    resumed.load_state_dict(state)
    for it in range(3011, 3021):
        source2.iteration = it
        resumed.on_step_begin(it)
        resumed.on_step_end(it, loss=1.0)
    assert [r.iteration for r in resumed.tracks] == [r.iteration for r in straight.tracks if r.iteration > 3010]
    assert [r.iteration for r in resumed.tracks] == [3016]


class TimedOutliers(SampledOutliers):
    """:class:`SampledOutliers` whose codec times are ``factor(iteration)`` times the profiled ones."""

    def __init__(self, profile, factor):
        super().__init__(lambda it: HIGH)
        self.profile, self.factor = profile, factor

    def measure(self, policy):
        samples = super().measure(policy)
        times = {op: self.profile.op(op).codecs[OUTLIER_CODEC] for op in samples}
        k = self.factor(self.iteration)
        return {op: OpSample(s.outlier_channels, s.channels, s.shapes, s.dtype, times[op].compress_time_s * k,
                             times[op].decompress_time_s * k) for op, s in samples.items()}


def _timed(factor):
    evo, _, applied, policy = setup(lambda it: HIGH)
    profiled = evo.profile
    source = TimedOutliers(profiled, factor)
    evo.source = source
    return evo, source, applied, profiled


def _times(profile):
    """The outlier codec's times of the ops that save for backward (the others keep the profiled ones)."""
    return {op: (profile.op(op).codecs[OUTLIER_CODEC].compress_time_s,
                 profile.op(op).codecs[OUTLIER_CODEC].decompress_time_s)
            for op in OUTLIER_OPS if profile.op(op).saved_bytes > 0}


def test_a_one_off_slow_timing_changes_no_codec_time_and_switches_nothing() -> None:
    """A timing taken while the host ran something else (4x, at one tracking iteration) is not adopted: the
    profile's time is the median of every time taken so far. Adopting the last sample, tiny's evolution switched
    policy at five of seven tracking iterations on a busy host."""
    evo, source, applied, profiled = _timed(lambda it: 4.0 if it == 2 else 1.0)
    run(evo, source, 40)
    assert _times(evo.profile) == _times(profiled)
    assert evo.switches == [] and applied == []


def test_a_lasting_change_of_codec_time_is_adopted_at_its_second_sample() -> None:
    evo, source, _, profiled = _timed(lambda it: 4.0 if it >= 2 else 1.0)
    run(evo, source, 2)
    assert _times(evo.profile) == _times(profiled)  # profiled, 1x, 4x: the median is the profiled time
    run_from(evo, source, 3, 4)  # 1x, 4x, 4x
    assert _times(profiled)
    for op, times in _times(profiled).items():
        assert _times(evo.profile)[op] == pytest.approx(tuple(4.0 * t for t in times)), op


def test_a_resumed_evolution_keeps_the_times_its_medians_are_taken_over() -> None:
    """The third sample at 8 makes the change from iteration 4 on the median: only if the 4x at 4 was kept."""
    straight, source, _, _ = _timed(lambda it: 4.0 if it >= 4 else 1.0)
    run(straight, source, 8)
    resumed, source2, _, _ = _timed(lambda it: 4.0 if it >= 4 else 1.0)
    run(resumed, source2, 4)
    state = resumed.state_dict()
    again, source3, _, _ = _timed(lambda it: 4.0 if it >= 4 else 1.0)
    again.load_state_dict(state)
    run_from(again, source3, 5, 8)
    assert _times(again.profile) == _times(straight.profile) != _times(resumed.profile)


def run_from(evo, source, first, last):
    for it in range(first, last + 1):
        source.iteration = it
        evo.on_step_begin(it)
        evo.on_step_end(it, loss=1.0)


def test_deterministic_mode_keeps_the_profiled_codec_times_and_still_follows_outliers(tmp_path) -> None:
    """Under ``--deterministic-mode`` a lasting change of codec time is never adopted (a resumed run measures
    other times than the straight one, and a switch they decided would make the two train differently), while
    falling outliers still switch where they do without it."""
    from types import SimpleNamespace

    from megatron_adacc.adacc.integration.evolution import build_extension
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    evo, source, _, profiled = _timed(lambda it: 4.0 if it >= 2 else 1.0)
    evo.retime = False
    run(evo, source, 16)
    assert _times(profiled) and _times(evo.profile) == _times(profiled)

    evo, source, _, _ = setup(lambda it: HIGH if it < 6 else 0.01)
    evo.retime = False
    run(evo, source, 40)
    assert [r.iteration for r in evo.switches] == [8]

    db = ProfileDB(tmp_path / "p.sqlite")
    policy, _ = solve_policy(analytic_profile(SIG), _tight(analytic_profile(SIG)))
    policy.profile = {"db": str(db.path), "id": db.put(analytic_profile(SIG))}
    assert build_extension(SimpleNamespace(adacc_no_evolution=False), None, policy).retime
    assert not build_extension(SimpleNamespace(adacc_no_evolution=False, deterministic_mode=True), None,
                               policy).retime
