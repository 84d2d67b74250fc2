"""Adaptive policy evolution (paper section 3.4).

Outlier counts, and with them the compression ratio of outlier-separated tensors, drift during training,
mostly early on. Training iterations are therefore split into normal and *tracking* iterations, spaced by
exponential backoff: iterations 1, 2, 4, 8, ... and then every ``cap`` iterations. At the end of each
tracking iteration the extension

1. reads the compressed sizes the runtime just measured for outlier-separated (``int4_outlier``) tensors,
2. updates the profile's compression ratios (ops the current policy does not compress with that codec
   move by the median relative change of those it does),
3. re-solves the MILP, and
4. switches policy before the next iteration when the new one is predicted faster by at least
   ``min_gain`` and fits the budget, or when the current policy no longer fits (outliers grew).

Every tracking iteration and every switch is logged and reported. ``--adacc-no-evolution`` turns it off.

The statistics come from a :class:`StatsSource`; :class:`RuntimeStats` reads the runtime's per-layer,
per-op accounting (``megatron_adacc.adacc.runtime.accounting``), which records the bytes each compressed op
actually holds after every forward.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_adacc.adacc.policy.ops import OPS, OUTLIER_CODEC, Action
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.policy.profile import CodecProfile, LayerProfile
from megatron_adacc.adacc.policy.solver import SolveOptions, evaluate_policy, solve_policy
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError
from megatron_adacc.core.extension import TrainingExtension


class StatsSource(Protocol):
    """Where tracking iterations get fresh statistics of outlier-separated tensors."""

    def measure(self, policy: Policy) -> Mapping[str, float]:
        """``{op name: compressed bytes per layer}`` of the ``int4_outlier`` tensors the runtime compressed in
        the last forward (averaged over layers); ops it did not compress that way are absent."""
        ...


class RuntimeStats:
    """Reads ``megatron_adacc.adacc.runtime.accounting.latest()``: per layer, the bytes each op holds."""

    def measure(self, policy: Policy) -> Mapping[str, float]:
        from megatron_adacc.adacc.runtime import accounting

        per_op: dict[str, list[int]] = {}
        for layer, entry in accounting.latest().items():
            if not 0 <= layer < policy.num_layers:
                continue
            for op, d in policy.layer_decisions(layer).items():
                if d.action == Action.COMPRESS and d.codec == OUTLIER_CODEC and entry.per_op.get(op):
                    per_op.setdefault(op, []).append(int(entry.per_op[op]))
        return {op: statistics.fmean(v) for op, v in per_op.items()}


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
    measured: dict[str, float]
    current_time_s: float
    current_memory_bytes: float
    candidate_time_s: float | None
    candidate_memory_bytes: float | None
    switched: bool
    reason: str


@dataclass
class PolicyEvolution(TrainingExtension):
    """The training extension that re-solves on drift. ``apply(policy)`` installs a policy for the next
    iteration (by default ``megatron_adacc.adacc.integration.dispatch`` with the model's config)."""

    profile: LayerProfile
    policy: Policy
    budget_bytes: float
    options: SolveOptions = field(default_factory=SolveOptions)
    source: StatsSource = field(default_factory=RuntimeStats)
    apply: Callable[[Policy], None] | None = None
    cap: int = 1024
    min_gain: float = 0.02
    log: Callable[[str], None] = field(default=lambda m: print(f"[adacc evolution] {m}", file=sys.stderr,
                                                                   flush=True))
    name: str = "adacc_evolution"

    def __post_init__(self) -> None:
        self._schedule = tracking_iterations(self.cap)
        self._next = next(self._schedule)
        self.tracks: list[TrackRecord] = []
        self.switches: list[TrackRecord] = []

    # ----------------------------------------------------------------------------- extension hooks
    def on_step_end(self, iteration: int, loss: float) -> None:
        while self._next < iteration:  # resumed runs and skipped calls catch up with the schedule
            self._next = next(self._schedule)
        if iteration != self._next:
            return
        self._next = next(self._schedule)
        self.track(iteration)

    def state_dict(self) -> dict:
        from megatron_adacc.adacc.policy.io import policy_to_json

        return {"policy": policy_to_json(self.policy), "profile": self.profile.to_json(),
                "switches": [r.iteration for r in self.switches]}

    def load_state_dict(self, state: dict) -> None:
        from megatron_adacc.adacc.policy.io import policy_from_json

        if "policy" in state:
            self.policy = policy_from_json(state["policy"])
            self.profile = LayerProfile.from_json(state["profile"])
            if self.apply is not None:
                self.apply(self.policy)

    def report(self) -> dict[str, Any]:
        return {"tracking_iterations": [r.iteration for r in self.tracks],
                "switches": [{"iteration": r.iteration, "reason": r.reason, "time_s": r.candidate_time_s,
                              "memory_bytes": r.candidate_memory_bytes} for r in self.switches]}

    # ----------------------------------------------------------------------------------- one track
    def updated_profile(self, measured: Mapping[str, float]) -> LayerProfile:
        """The profile with ``int4_outlier`` sizes replaced by the measurement (see the module doc)."""
        ratios = []
        for op, nbytes in measured.items():
            old = self.profile.op(op).codecs.get(OUTLIER_CODEC)
            if old is not None and old.compressed_bytes > 0:
                ratios.append(nbytes / old.compressed_bytes)
        if not ratios:
            return self.profile
        drift = statistics.median(ratios)
        updates: dict[str, dict[str, CodecProfile]] = {}
        for spec in OPS:
            old = self.profile.op(spec.name).codecs.get(OUTLIER_CODEC)
            if old is None:
                continue
            new_bytes = measured.get(spec.name, old.compressed_bytes * drift)
            updates[spec.name] = {OUTLIER_CODEC: CodecProfile(int(round(new_bytes)), old.compress_time_s,
                                                              old.decompress_time_s, dict(old.stats))}
        return self.profile.with_codec_update(updates)

    def track(self, iteration: int) -> TrackRecord:
        measured = dict(self.source.measure(self.policy))
        self.profile = self.updated_profile(measured)
        chain = self.options.chain_aware
        current = evaluate_policy(self.profile, self.policy, chain_aware=chain)
        candidate: Policy | None = None
        try:
            candidate, _ = solve_policy(self.profile, self.budget_bytes, self.options,
                                        num_layers=self.policy.num_layers, profile_ref=self.policy.profile,
                                        signature=self.policy.signature)
        except InfeasibleBudgetError as e:
            reason = f"no policy fits any more ({e}); keeping the current one"
        cand = evaluate_policy(self.profile, candidate, chain_aware=chain) if candidate is not None else None
        fits = current["memory_bytes"] <= self.budget_bytes
        switched = False
        if cand is not None:
            if not fits:
                switched, reason = True, "current policy no longer fits the budget"
            elif cand["time_s"] < current["time_s"] * (1 - self.min_gain) and not candidate.same_decisions(self.policy):
                switched, reason = True, "predicted faster"
            else:
                reason = "kept (no predicted gain)"
        record = TrackRecord(iteration, measured, current["time_s"], current["memory_bytes"],
                             cand["time_s"] if cand else None, cand["memory_bytes"] if cand else None, switched, reason)
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


def build_extension(args: Any, config: Any, policy: Policy) -> PolicyEvolution | None:
    """The evolution extension for a solved policy (``--adacc-policy auto``), or None when turned off or
    when the policy does not reference a stored profile (presets, hand-written files)."""
    if getattr(args, "adacc_no_evolution", False) or policy.profile is None or policy.budget_bytes is None:
        return None
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    ref = policy.profile
    profile = ProfileDB.referenced(ref)  # a policy file names what to read, never where to write
    if profile is None:
        print(f"[adacc] policy evolution is off: the profile the policy was solved from ({ref.get('db')}, "
              f"#{ref.get('id')}) is not available here", file=sys.stderr, flush=True)
        return None

    def apply(new: Policy) -> None:
        from megatron_adacc.adacc.integration import install

        install(new, config=config)

    return PolicyEvolution(profile=profile, policy=policy, budget_bytes=float(policy.budget_bytes),
                           options=SolveOptions.from_args(args), apply=apply,
                           cap=int(getattr(args, "adacc_evolution_cap", 1024) or 1024))
