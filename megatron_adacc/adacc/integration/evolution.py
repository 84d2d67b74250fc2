"""Adaptive policy evolution (paper section 3.4).

Outlier counts, and with them the compression ratio of outlier-separated tensors, drift during training,
mostly early on. Training iterations are therefore split into normal and *tracking* iterations, spaced by
exponential backoff: iterations 1, 2, 4, 8, ... and then every ``cap`` iterations, counted from the first
iteration evolution runs (a run continuing a checkpoint made without it profiles anew and tracks from there).
On each tracking iteration
the extension

1. samples the outlier statistics of EVERY op that offers outlier-separated INT4 (``int4_outlier``), whatever
   the current policy does with it (keep, compress or recompute): its outlier channel count, the size the codec
   would give its output now, and the codec's compress / decompress times re-measured on the real tensors
   (:mod:`megatron_adacc.adacc.integration.outlier_probe`, which runs this rank's layers again after the step,
   without gradients and without touching the random streams), merged over every rank so that all ranks
   re-solve from the same figures and switch together;
2. updates the profile: each op's ``int4_outlier`` compressed bytes are scaled by the ratio of the codec's size
   at the new count to its size at the profiled one (so the profile keeps the runtime-attributed units it was
   measured in), its raw codec times replaced when the median of the latest times taken moved beyond timing
   noise (:data:`TIME_CHANGE`, :class:`CodecTimings`; the profile's ``codec_time_scale`` still calibrates
   them; never under ``--deterministic-mode``, :attr:`PolicyEvolution.retime`), and the count stored as the new
   reference;
3. re-solves the MILP, and
4. switches policy before the next iteration when the new one is predicted faster by at least ``min_gain`` and
   fits the budget, or when the current policy no longer fits (outliers grew).

Sampling every candidate is what lets an op recomputed at profile time, because its outliers were many,
become compressed once they fall: the runtime's accounting sees only the tensors it compressed.

Every tracking iteration and every switch is logged and reported, and so is the outlier count per op at each
tracking iteration (the paper's Fig. 4; ``report()["outlier_channels"]``). ``--adacc-no-evolution`` turns it off.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from megatron_adacc.adacc.policy.ops import OPS, OUTLIER_CODEC, Action
from megatron_adacc.adacc.policy.options import SolveOptions
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.policy.profile import CodecProfile, LayerProfile
from megatron_adacc.compat.process import forked
from megatron_adacc.core.extension import TrainingContext, TrainingExtension
from megatron_adacc.core.log import get_logger

if TYPE_CHECKING:
    from megatron_adacc.adacc.integration.outlier_probe import OpSample


class StatsSource(Protocol):
    """Where tracking iterations get fresh outlier statistics (:class:`~.outlier_probe.OutlierProbe`)."""

    def setup(self, model: Sequence[Any]) -> None:
        """Called once with this rank's (unwrapped) model chunks."""
        ...

    def arm(self) -> None:
        """The coming iteration is a tracking one: get ready to sample its forward."""
        ...

    def measure(self, policy: Policy) -> Mapping[str, OpSample]:
        """``{op name: OpSample}`` for the ops offering ``int4_outlier`` that were sampled since :meth:`arm`."""
        ...


#: A re-measured codec time replaces the profiled one only when it is off by more than this factor either way:
#: one layer's timing varies by tens of percent from run to run, and adopting that noise would let two runs that
#: saw the same outliers (a resumed run and a straight one) solve differently.
TIME_CHANGE = 1.5


#: A re-solved policy replaces the running one when it is predicted faster by at least this fraction: the cost
#: model's own error is a few percent, and a switch re-installs every layer's policy.
MIN_GAIN = 0.02


def _retimed(profiled: float, measured: float | None) -> float:
    if measured is None or (profiled > 0 and 1 / TIME_CHANGE <= measured / profiled <= TIME_CHANGE):
        return profiled
    return measured


#: How many of an op's latest codec times (the profile's among them, until as many samples came) the time a
#: re-solve uses is the median of (:class:`CodecTimings`).
TIME_WINDOW = 3


@dataclass
class CodecTimings:
    """The latest raw ``int4_outlier`` times of each op, the profile's first, then each tracking iteration's.

    What replaces the profile's time is the median of the last :data:`TIME_WINDOW` (the lower middle one of
    two), not the last sample: one timing taken while the host ran something else was 2-5x the profiled one on
    a shared CPU, and adopting it switched tiny's policy at five of seven tracking iterations and back. A change
    that lasts becomes the median at the second sample that shows it; a slower one-off never does. Kept in
    checkpoints, so that a resumed run re-solves from the figures the straight one has."""

    times: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, op: str, profiled: CodecProfile, sample: OpSample) -> OpSample:
        """``sample`` with its times replaced by the medians of ``op``'s latest times (``profiled``'s first)."""
        seen = self.times.setdefault(op, [(profiled.compress_time_s, profiled.decompress_time_s)])
        if sample.compress_time_s is None or sample.decompress_time_s is None:
            return sample
        seen.append((sample.compress_time_s, sample.decompress_time_s))
        del seen[:-TIME_WINDOW]
        return replace(sample, compress_time_s=statistics.median_low(c for c, _ in seen),
                       decompress_time_s=statistics.median_low(d for _, d in seen))

    def to_json(self) -> dict[str, list[list[float]]]:
        return {op: [list(t) for t in seen] for op, seen in self.times.items()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CodecTimings:
        return cls({op: [(float(c), float(d)) for c, d in seen] for op, seen in obj.items()})


def resampled(old: CodecProfile, sample: OpSample, *, saved: bool) -> CodecProfile:
    """An op's ``int4_outlier`` profile after ``sample``: bytes scaled by the codec's size ratio between the new
    count and the profiled one, raw times re-measured (beyond :data:`TIME_CHANGE`; kept as profiled when the op
    saves nothing for backward: the profiler timed its outputs, which only a segment's stash compresses, and the
    sample times saved tensors), and the new count as the next reference. A profile that
    recorded no count (``outlier_channels``, or an analytic ``outlier_fraction``) keeps its bytes: the sample
    calibrates it."""
    before = old.stats.get("outlier_channels")
    if before is None and "outlier_fraction" in old.stats:
        before = float(old.stats["outlier_fraction"]) * sample.channels
    nbytes = float(old.compressed_bytes)
    base = sample.codec_bytes_at(float(before)) if before is not None else 0.0
    if base > 0:
        nbytes *= sample.codec_bytes / base
    tc, td = old.compress_time_s, old.decompress_time_s
    if saved:
        tc, td = _retimed(tc, sample.compress_time_s), _retimed(td, sample.decompress_time_s)
    stats = {k: v for k, v in old.stats.items() if k != "outlier_fraction"}
    stats.update(outlier_channels=sample.outlier_channels, channels=sample.channels)
    return CodecProfile(int(round(nbytes)), tc, td, stats)


def tracking_iterations(cap: int):
    """1, 2, 4, ... doubling up to ``cap``, then every ``cap`` iterations (a generator)."""
    if cap < 1:
        raise ValueError(f"--adacc-evolution-cap must be >= 1, got {cap}")
    it, interval = 1, 1
    while True:
        yield it
        it += interval
        interval = min(interval * 2, cap)


@dataclass
class TrackRecord:
    iteration: int
    measured: dict[str, OpSample]
    current_time_s: float
    current_memory_bytes: float
    candidate_time_s: float | None
    candidate_memory_bytes: float | None
    switched: bool
    reason: str
    same_policy: bool = False
    """The re-solve found the policy already running."""


@dataclass
class OutlierSeries:
    """Outlier channels per op at each tracking iteration (the paper's Fig. 4), beside the profiled counts."""

    profiled: dict[str, float] = field(default_factory=dict)
    points: dict[int, dict[str, float]] = field(default_factory=dict)
    channels: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of_profile(cls, profile: LayerProfile) -> OutlierSeries:
        counts = {spec.name: profile.op(spec.name).codecs[OUTLIER_CODEC].stats.get("outlier_channels")
                  for spec in OPS if OUTLIER_CODEC in profile.op(spec.name).codecs}
        return cls(profiled={op: k for op, k in counts.items() if k is not None})

    def add(self, iteration: int, samples: Mapping[str, OpSample]) -> None:
        self.points[iteration] = {op: s.outlier_channels for op, s in samples.items()}
        self.channels.update({op: s.channels for op, s in samples.items()})

    def to_json(self) -> dict[str, Any]:
        """``{"iterations": [...], "ops": {op: [count or None per iteration]}, "channels": {op: C},
        "profiled": {op: count}}``: what the run's JSON and Fig. 4 read."""
        its = sorted(self.points)
        ops = [spec.name for spec in OPS if any(spec.name in self.points[i] for i in its)]
        return {"iterations": its, "channels": dict(self.channels), "profiled": dict(self.profiled),
                "ops": {op: [_rounded(self.points[i].get(op)) for i in its] for op in ops}}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> OutlierSeries:
        its = [int(i) for i in obj.get("iterations", [])]
        points: dict[int, dict[str, float]] = {i: {} for i in its}
        for op, values in obj.get("ops", {}).items():
            for i, v in zip(its, values):
                if v is not None:
                    points[i][op] = float(v)
        return cls(dict(obj.get("profiled", {})), points, {op: int(c) for op, c in obj.get("channels", {}).items()})


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(float(value), 2)


_default_log = get_logger("adacc.evolution").info


@dataclass
class PolicyEvolution(TrainingExtension):
    """The training extension that re-solves on drift. ``apply(policy)`` installs a policy for the next
    iteration (by default ``megatron_adacc.adacc.integration.dispatch`` with the model's config); ``source``
    defaults to an :class:`~.outlier_probe.OutlierProbe` with the options' Z threshold."""

    profile: LayerProfile
    policy: Policy
    budget_bytes: float
    options: SolveOptions = field(default_factory=SolveOptions)
    source: StatsSource | None = None
    apply: Callable[[Policy], None] | None = None
    cap: int = 1024
    min_gain: float = MIN_GAIN
    in_flight: int = 1
    """Micro-batches whose activations the policy's layers hold at once (a pipeline stage's, under 1F1B): the
    solve and the comparison count each."""
    isolate_solves: bool = False
    """Re-solve in a forked child (``planning.isolated_solves``: on the CPU, where the budget is peak RSS)."""
    retime: bool = True
    """Adopt the codec times re-measured on tracking iterations (step 2 above). Off under Megatron's
    ``--deterministic-mode``: timings differ from run to run, and a switch they decide makes a resumed run, or a
    second run from the same profile, train differently from the first; outlier statistics do not."""
    log: Callable[[str], None] = _default_log
    name: str = "adacc_evolution"
    state_optional = True  # evolution starts from the run's own profile and policy

    def __post_init__(self) -> None:
        if self.source is None:
            from megatron_adacc.adacc.integration.outlier_probe import OutlierProbe

            self.source = OutlierProbe(self.options.outlier_z, log=self.log)
        self._origin: int | None = None
        """The iteration before the first one this evolution watched: its schedule counts from there."""
        self._schedule = tracking_iterations(self.cap)
        self._next = next(self._schedule)
        self.tracks: list[TrackRecord] = []
        self.switches: list[TrackRecord] = []
        self.outliers = OutlierSeries.of_profile(self.profile)
        self.timings = CodecTimings()

    # ----------------------------------------------------------------------------- extension hooks
    def setup(self, ctx: TrainingContext) -> None:
        self.source.setup(ctx.model)

    def _is_tracking(self, iteration: int) -> bool:
        # The schedule starts where the profile was taken: a run that continues a checkpoint made without
        # evolution (stock training, another policy) profiled just now, and the drift worth sampling early is
        # the one since then. A resumed evolution keeps the origin it saved, so its tracking iterations are the
        # straight run's.
        if self._origin is None:
            self._origin = iteration - 1
        while self._origin + self._next < iteration:  # resumed runs and skipped calls catch up with the schedule
            self._next = next(self._schedule)
        return iteration == self._origin + self._next

    def on_step_begin(self, iteration: int) -> None:
        if self._is_tracking(iteration):
            self.source.arm()

    def on_step_end(self, iteration: int, loss: float) -> None:
        if not self._is_tracking(iteration):
            return
        self._next = next(self._schedule)
        self.track(iteration)

    def state_dict(self) -> dict:
        from megatron_adacc.adacc.policy.io import policy_to_json

        return {"policy": policy_to_json(self.policy), "profile": self.profile.to_json(),
                "switches": [r.iteration for r in self.switches], "outlier_channels": self.outliers.to_json(),
                "codec_times": self.timings.to_json(), "origin": self._origin or 0}

    def load_state_dict(self, state: dict) -> None:
        from megatron_adacc.adacc.policy.io import policy_from_json

        if "policy" in state:
            self.policy = policy_from_json(state["policy"])
            self.profile = LayerProfile.from_json(state["profile"])
            if "outlier_channels" in state:
                self.outliers = OutlierSeries.from_json(state["outlier_channels"])
            # checkpoints from before the times were kept start their medians from the saved profile
            self.timings = CodecTimings.from_json(state.get("codec_times", {}))
            self._origin = int(state.get("origin", 0))  # checkpoints from before the origin was saved began at 0
            if self.apply is not None:
                self.apply(self.policy)

    def report(self) -> dict[str, Any]:
        return {"tracking_iterations": [r.iteration for r in self.tracks],
                # how close each tracking iteration came to a switch: the running policy's predicted overhead, the
                # re-solved one's, and whether the re-solve found the running policy again
                "tracks": [[r.iteration, r.current_time_s, r.candidate_time_s, r.same_policy] for r in self.tracks],
                "switches": [{"iteration": r.iteration, "reason": r.reason, "time_s": r.candidate_time_s,
                              "memory_bytes": r.candidate_memory_bytes, "from_time_s": r.current_time_s,
                              "from_memory_bytes": r.current_memory_bytes} for r in self.switches],
                "outlier_channels": self.outliers.to_json()}

    # ----------------------------------------------------------------------------------- one track
    def updated_profile(self, measured: Mapping[str, OpSample]) -> LayerProfile:
        """The profile with every sampled op's ``int4_outlier`` entry :func:`resampled`."""
        updates: dict[str, dict[str, CodecProfile]] = {}
        for op, sample in measured.items():
            profiled = self.profile.op(op)
            old = profiled.codecs.get(OUTLIER_CODEC)
            if old is not None:  # the profiler found the codec does not apply to this op: nothing to update
                sample = (self.timings.add(op, old, sample) if self.retime
                          else replace(sample, compress_time_s=None, decompress_time_s=None))
                updates[op] = {OUTLIER_CODEC: resampled(old, sample, saved=profiled.saved_bytes > 0)}
        return self.profile.with_codec_update(updates) if updates else self.profile

    def track(self, iteration: int) -> TrackRecord:
        from megatron_adacc.adacc.integration.outlier_probe import agreed

        measured = agreed(self.source.measure(self.policy))
        self.outliers.add(iteration, measured)
        self.profile = self.updated_profile(measured)
        # the evaluations and the solve together: the cost model and the solver stay out of this process where
        # the solves fork (``planning.isolated_solves``)
        inputs = (self.profile, self.policy, self.budget_bytes, self.options, self.in_flight)
        current, candidate, cand, refusal = (forked(lambda: resolve(*inputs)) if self.isolate_solves
                                             else resolve(*inputs))
        if refusal is not None:
            reason = f"no policy fits any more ({refusal}); keeping the current one"
        fits = current["memory_bytes"] <= self.budget_bytes
        same = candidate is not None and candidate.same_decisions(self.policy)
        switched = False
        if cand is not None:
            if not fits:
                switched, reason = True, "current policy no longer fits the budget"
            elif cand["time_s"] < current["time_s"] * (1 - self.min_gain) and not same:
                switched, reason = True, "predicted faster"
            else:
                reason = "kept (no predicted gain)"
        record = TrackRecord(iteration, measured, current["time_s"], current["memory_bytes"],
                             cand["time_s"] if cand else None, cand["memory_bytes"] if cand else None, switched, reason,
                             same_policy=same)
        self.tracks.append(record)
        if switched:
            assert candidate is not None and cand is not None
            self.log(f"iteration {iteration}: switching policy ({reason}): predicted overhead "
                     f"{current['time_s'] * 1e3:.2f} -> {cand['time_s'] * 1e3:.2f} ms, memory "
                     f"{current['memory_bytes'] / 2**20:.1f} -> {cand['memory_bytes'] / 2**20:.1f} MiB")
            candidate.name = f"{self.policy.name or 'adacc'}@{iteration}"
            self.policy = candidate
            self.switches.append(record)
            if self.apply is not None:
                self.apply(candidate)
        return record


def resolve(profile: LayerProfile, policy: Policy, budget_bytes: float, options: SolveOptions,
            in_flight: int) -> tuple[dict[str, float], Policy | None, dict[str, float] | None, str | None]:
    """One tracking iteration's solver work: the running policy evaluated on ``profile``, the policy solved
    afresh, that one evaluated, and the refusal's words where nothing fits any more."""
    from megatron_adacc.adacc.policy.solver import evaluate_stage, solve_stage
    from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError

    chain = options.chain_aware
    current = evaluate_stage(profile, policy, in_flight, chain_aware=chain)
    try:
        candidate, _ = solve_stage(profile, budget_bytes, options, layers=policy.num_layers, in_flight=in_flight,
                                   profile_ref=policy.profile, signature=policy.signature)
    except InfeasibleBudgetError as e:
        return current, None, None, str(e)
    return current, candidate, evaluate_stage(profile, candidate, in_flight, chain_aware=chain), None


def _solved_with(args: Any, policy: Policy, profile: LayerProfile) -> SolveOptions:
    """The options to re-solve ``policy`` under: the run's, with the process memory the policy was solved
    against where the run names none. A policy file solved on the CPU counted the process's own memory in its
    static bytes; re-solved without it, evolution would find everything fits and keep everything, over budget."""
    options = SolveOptions.from_args(args)
    static = (policy.predicted or {}).get("static_bytes")
    if not options.process_baseline_bytes and static is not None:
        options.process_baseline_bytes = max(0.0, float(static) - float(profile.static_bytes))
    return options


@dataclass
class EvolutionStart:
    """What a run's evolution re-solves from, prepared where the policy was solved (:mod:`~.planning`): the
    profile the policy names, charged with this run's model states and workspace as its first solve was; the
    policy of this rank's pipeline stage, the micro-batches the stage holds in flight, and the solve's options."""

    profile: LayerProfile
    policy: Policy
    in_flight: int
    options: SolveOptions


def evolution_start(args: Any, config: Any, policy: Policy) -> EvolutionStart | None:
    """Where evolution starts for a solved policy (``--adacc-policy auto``), or None when turned off, when the
    policy does not reference a stored profile (presets, hand-written files), or when it keeps everything: no
    re-solve can better that one (it costs no time, and its memory does not depend on outliers), and the
    probe would only spend the tracking iterations' time and, on the CPU, 0.9 MiB of llama-tiny's peak RSS."""
    if getattr(args, "adacc_no_evolution", False) or not policy.solved:
        return None
    # the whole policy, not this stage's: every rank must track, or none (their samples are merged)
    if not any(n for action, n in policy.counts().items() if action != Action.KEEP):
        get_logger().info("policy evolution is off: the policy keeps everything, which no re-solve can better")
        return None
    from megatron_adacc.adacc.integration.model_states import charge_static, stage_layout, this_stage
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    ref = policy.profile
    profile = ProfileDB.referenced(ref)  # a policy file names what to read, never where to write
    if profile is None:
        get_logger().warning(f"policy evolution is off: the profile the policy was solved from ({ref.get('db')}, "
                             f"#{ref.get('id')}) is not available here")
        return None
    held = 1
    if config is not None:  # re-solves count this run's model states and workspace, as its first solve did
        profile = charge_static(profile, args, config)
        if (getattr(config, "pipeline_model_parallel_size", 1) or 1) > 1:
            # a pipeline stage re-solves its own layers for its micro-batches in flight, as auto solved them
            stage = this_stage()
            _, layers, held = stage_layout(args, config)[stage]
            policy = policy.stage(stage * layers, layers) if policy.num_layers != layers else policy
    return EvolutionStart(profile, policy, held, _solved_with(args, policy, profile))


def build_extension(args: Any, config: Any, policy: Policy,
                    start: EvolutionStart | None = None) -> PolicyEvolution | None:
    """The evolution extension for a solved policy, from ``start`` (:func:`evolution_start` of the same
    arguments when not given), or None when :func:`evolution_start` finds none."""
    start = start or evolution_start(args, config, policy)
    if start is None:
        return None
    from megatron_adacc.adacc.integration.planning import isolated_solves, run_device

    def apply(new: Policy) -> None:
        from megatron_adacc.adacc.integration import install

        install(new, config=config)

    return PolicyEvolution(profile=start.profile, policy=start.policy, budget_bytes=float(start.policy.budget_bytes),
                           options=start.options, apply=apply,
                           cap=int(getattr(args, "adacc_evolution_cap", 1024) or 1024), in_flight=start.in_flight,
                           isolate_solves=isolated_solves(run_device(args)),
                           retime=not getattr(args, "deterministic_mode", False))
