"""The GACT controller: one object that compresses a model's saved tensors and adapts their bit widths.

Plain PyTorch::

    ctl = gact.Controller(model, level="L1")          # 4 bits per value on average
    for x, y in loader:
        loss = ctl.step(lambda: train_step(x, y))       # train_step runs forward + backward, returns the loss
        optimizer.step(); optimizer.zero_grad()

``step(fn)`` re-estimates the sensitivities every ``adapt_interval`` iterations (Algorithm 1 runs ``fn``
``L + 1`` extra times with the gradients discarded), runs ``fn`` with the hooks installed, and feeds the
resulting gradients to the variance monitor. For manual control, ``with ctl:`` installs the hooks around any
forward (+ backward), ``ctl.adapt(fn)`` runs the estimation, ``ctl.observe_gradients()`` the monitor.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Self

import torch

from megatron_adacc.gact.allocation import (
    BIT_LEVELS,
    KEEP_BITS,
    allocate_bits,
    predicted_variance,
    variance_factor,
)
from megatron_adacc.gact.hooks import CodecFactory, SavedTensorCompressor, mix_seed
from megatron_adacc.gact.levels import Level
from megatron_adacc.gact.sensitivity import (
    GradientVarianceMonitor,
    frozen_rng,
    snapshot_gradients,
    squared_distance_inplace,
    zero_gradients,
)
from megatron_adacc.gact.swap import SwapManager

log = logging.getLogger(__name__)


class GactVarianceWarning(UserWarning):
    """The predicted compression variance is large next to the gradient's own variance: raise the bits."""


def _as_modules(model: Any) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    mods = list(model)
    if not mods or not all(isinstance(m, torch.nn.Module) for m in mods):
        raise TypeError("Controller(model=...) takes a torch.nn.Module or a list of them (model chunks)")
    return mods


class Controller:
    """Activation-compressed training for any torch model (GACT, Table 1 levels).

    Args:
        model: the module (or list of model chunks) being trained.
        level: ``"L0"`` (off), ``"L1"``, ``"L2"``, ``"CB1"``, ``"CB2"``.
        bits: average bits per activation value (the budget of the allocation).
        group_size: values per quantization group of the stochastic quantizer.
        adapt_interval: iterations between sensitivity re-estimations (``step`` counts iterations).
        adaptive: ``False`` gives fixed bits (every tensor at the largest level <= ``bits``).
        probe_bits: bit width at which Algorithm 1 compresses every tensor while probing (default: the
            fixed level for ``bits``, so the probes see the compression regime training uses).
        probe_repeats: seed pairs averaged per tensor (Algorithm 1 uses one).
        seed: base seed of the compressors' stochastic rounding.
        warn_ratio: warn when predicted compression variance > ``warn_ratio`` x gradient variance.
        warmup: gradient observations before the variance warning may fire.
        min_numel: float tensors smaller than this stay uncompressed (default: one group).
        codec_factory: ``get_codec``-compatible factory (default ``megatron_adacc.codecs.get_codec``).
    """

    def __init__(
        self,
        model: Any,
        level: str | Level = "L1",
        bits: float = 4.0,
        group_size: int = 256,
        adapt_interval: int = 1000,
        adaptive: bool = True,
        probe_bits: int | None = None,
        probe_repeats: int = 1,
        seed: int = 0,
        warn_ratio: float = 0.1,
        warmup: int = 10,
        variance_momentum: float = 0.9,
        min_numel: int | None = None,
        codec_factory: CodecFactory | None = None,
        levels: Sequence[int] = BIT_LEVELS,
    ):
        self.modules = _as_modules(model)
        self.level = Level.parse(level)
        if not min(levels) <= bits <= KEEP_BITS:
            raise ValueError(f"bits={bits} is outside the bit levels {sorted(levels)}; try --gact-bits 4")
        if adapt_interval < 1:
            raise ValueError(f"adapt_interval must be >= 1, got {adapt_interval}")
        if probe_repeats < 1:
            raise ValueError(f"probe_repeats must be >= 1, got {probe_repeats}")
        self.levels = tuple(sorted(set(levels)))
        self.avg_bits = float(bits)
        self.fixed_bits = max(b for b in self.levels if b <= bits)
        self.probe_bits = int(probe_bits) if probe_bits is not None else min(self.fixed_bits, 8)
        if self.probe_bits >= KEEP_BITS:
            raise ValueError("probe_bits must be below 32: an uncompressed tensor has no variance to measure")
        self.group_size = group_size
        self.adapt_interval = adapt_interval
        self.adaptive = adaptive
        self.probe_repeats = probe_repeats
        self.seed = seed
        self.warn_ratio = warn_ratio
        self.warmup = warmup
        self.iteration = 0
        self.bits: dict[int, int] = {}
        self.sensitivity: dict[int, float] = {}
        self._dims: dict[int, int] = {}
        self._probe: tuple[int, int] | None = None  # (probe seed base, perturbed tensor id or -1)
        self.monitor = GradientVarianceMonitor(variance_momentum)
        self.adaptations = 0
        self.probe_seconds = 0.0
        self.probe_noise_floor = 0.0
        self.last_predicted_variance: float | None = None
        self.notes: list[str] = []
        self._entered: list[Any] = []
        self.microbatches_per_step = 1

        self.swap = SwapManager(self._device()) if self.level.swaps else None
        self.compressor = SavedTensorCompressor(
            self._model_tensors, group_size, self._bits_for, self._seed_for,
            codec_factory=codec_factory, min_numel=min_numel, swap=self.swap,
        )
        if self.level.recomputes:
            from megatron_adacc.gact.megatron import enable_full_recompute

            self.notes.append(enable_full_recompute(self.modules))
        if self.level.efficient_attention:
            from megatron_adacc.gact.megatron import enable_memory_efficient_attention

            self.notes.append(enable_memory_efficient_attention(self.modules))

    # ------------------------------------------------------------------ helpers
    def _device(self) -> torch.device:
        for m in self.modules:
            for p in m.parameters():
                return p.device
        return torch.device("cpu")

    def _model_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for m in self.modules:
            out.extend(m.parameters())
            out.extend(m.buffers())
        return out

    @property
    def parameters(self) -> list[torch.Tensor]:
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    def _bits_for(self, tensor_id: int, numel: int) -> int:
        if self._probe is not None:
            return self.probe_bits
        if not self.adaptive:
            return self.fixed_bits
        self._dims.setdefault(tensor_id, numel)
        if self._dims.get(tensor_id) == numel and tensor_id in self.bits:
            return self.bits[tensor_id]
        return self.fixed_bits  # not seen by an adaptation yet (or its shape changed)

    def _seed_for(self, tensor_id: int) -> int:
        if self._probe is not None:
            base, perturbed = self._probe
            # Algorithm 1: seeds r_1..r_L fixed; the perturbed tensor gets r_{L+1} instead.
            return mix_seed(base, tensor_id, 1 if tensor_id == perturbed else 0)
        return mix_seed(self.seed, self.compressor.passes, tensor_id)

    # ------------------------------------------------------------------ hooks
    def hooks(self):
        """Context manager installing the saved-tensor hooks for one forward + backward (no-op at L0)."""
        import contextlib

        if not self.level.compresses:
            return contextlib.nullcontext(self)
        return self.compressor.pass_context()

    def __enter__(self) -> Self:
        cm = self.hooks()
        cm.__enter__()
        self._entered.append(cm)
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered.pop().__exit__(*exc)

    # ------------------------------------------------------------------ training API
    def step(self, forward_backward: Callable[[], Any]) -> Any:
        """One training iteration: adapt if due, run ``forward_backward`` under the hooks, watch gradients."""
        self.maybe_adapt(forward_backward)
        with self.hooks():
            out = forward_backward()
        self.observe_gradients()
        self.iteration += 1
        return out

    def maybe_adapt(self, forward_backward: Callable[[], Any]) -> bool:
        if self.level.compresses and self.adaptive and self.iteration % self.adapt_interval == 0:
            self.adapt(forward_backward)
            return True
        return False

    def observe_gradients(self) -> None:
        """Feed the current gradients to the variance monitor (call after backward, before zero_grad)."""
        if self.level.compresses and self.adaptive:
            self.monitor.update(self.parameters)

    # ------------------------------------------------------------------ Algorithm 1
    def estimate_sensitivity(self, forward_backward: Callable[[], Any]) -> dict[int, float]:
        """``c_l`` for every saved tensor: ``0.5 ||g0 - g1||^2 / S(probe_bits)``, where ``g1`` differs from
        ``g0`` only in the seed of tensor ``l``'s compressor. ``L + 2`` evaluations per repeat (one extra
        re-runs ``g0`` unchanged to prove ``forward_backward`` is repeatable); gradients are left zeroed
        and every RNG is restored afterwards."""
        params = self.parameters
        sums: dict[int, float] = {}
        factor = variance_factor(self.probe_bits)
        self.compressor.recording = False

        def evaluate(base: int, perturbed: int) -> None:
            self._probe = (base, perturbed)
            zero_gradients(params)
            reset_rng()
            with self.compressor.pass_context():
                forward_backward()

        with frozen_rng() as reset_rng:
            try:
                for rep in range(self.probe_repeats):
                    base = mix_seed(self.seed, 0x5EED, self.adaptations, rep)
                    evaluate(base, -1)
                    n_tensors = self.compressor._next_id
                    ref = snapshot_gradients(params)
                    evaluate(base, -1)
                    control = squared_distance_inplace(params, ref)
                    for tid in range(n_tensors):
                        self._dims[tid] = self.compressor.tensors[tid].numel
                        evaluate(base, tid)
                        if self.compressor._next_id != n_tensors:
                            raise RuntimeError(
                                "GACT sensitivity probe: the model saved a different number of tensors in "
                                f"two identical passes ({n_tensors} vs {self.compressor._next_id}); the "
                                "forward must be deterministic for the probe (same batch, same branches)")
                        dist = squared_distance_inplace(params, ref)
                        sums[tid] = sums.get(tid, 0.0) + 0.5 * max(dist - control, 0.0) / factor
                    self._check_repeatable(control, sums, rep + 1)
                    del ref
            finally:
                self._probe = None
                self.compressor.recording = True
                zero_gradients(params)
        return {tid: s / self.probe_repeats for tid, s in sums.items()}

    def _check_repeatable(self, control: float, sums: dict[int, float], reps: int) -> None:
        """Algorithm 1 needs two gradient evaluations that differ *only* in one compressor's seed. If two
        evaluations with identical seeds already differ by as much as the perturbed ones, the probe function
        is not replaying one batch (or the kernels are non-deterministic) and every estimate is noise."""
        self.probe_noise_floor = control
        if control == 0.0:
            return
        typical = sorted(sums.values())[len(sums) // 2] * 2 * variance_factor(self.probe_bits) / reps
        if control > 0.1 * typical:
            raise RuntimeError(
                "GACT sensitivity probe: two evaluations with identical compressor seeds gave gradients "
                f"{control:.3e} apart (squared), comparable to the seed-perturbed ones ({typical:.3e}). The "
                "forward_backward passed to the controller must replay the same batch every call (and run "
                "deterministically); a function drawing a fresh batch per call cannot measure sensitivity.")

    def adapt(self, forward_backward: Callable[[], Any]) -> dict[int, int]:
        """Re-estimate sensitivities and re-allocate bits (greedy, budget ``bits`` on average)."""
        start = time.perf_counter()
        est = self.estimate_sensitivity(forward_backward)
        self.probe_seconds += time.perf_counter() - start
        # A non-finite estimate means the tensor is too sensitive to measure: treat it as the most sensitive.
        finite = [c for c in est.values() if math.isfinite(c)]
        cap = max(finite) * 1e3 if finite and max(finite) > 0 else 1.0
        self.sensitivity = {t: (c if math.isfinite(c) else cap) for t, c in est.items()}
        ids = sorted(self.sensitivity)
        alloc = allocate_bits([self.sensitivity[t] for t in ids], [self._dims[t] for t in ids],
                              self.avg_bits, self.levels)
        self.bits = dict(zip(ids, alloc))
        self.adaptations += 1
        self.last_predicted_variance = predicted_variance([self.sensitivity[t] for t in ids], alloc)
        self._check_variance()
        log.info("GACT: adapted %d tensors in %.2fs: %s", len(ids), time.perf_counter() - start,
                 self.bits_histogram())
        return dict(self.bits)

    def _check_variance(self) -> None:
        if self.last_predicted_variance is None or self.monitor.observations < self.warmup:
            return
        # The probe measures one micro-batch's gradient; a step averages ``microbatches_per_step`` of them
        # with independent compressor seeds, which divides the compression variance by that count.
        v = self.last_predicted_variance / self.microbatches_per_step
        gvar = self.monitor.variance
        if v > self.warn_ratio * gvar:
            warnings.warn(
                f"GACT: predicted compression variance {v:.3e} exceeds {self.warn_ratio} x the gradient "
                f"variance {gvar:.3e}; training may suffer. Raise the bits budget (--gact-bits).",
                GactVarianceWarning, stacklevel=3)

    # ------------------------------------------------------------------ reporting
    def bits_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for b in self.bits.values():
            hist[b] = hist.get(b, 0) + 1
        return dict(sorted(hist.items()))

    def effective_bits(self) -> float | None:
        """Average bits per value over all tracked tensors, weighted by size (the budget's measure)."""
        if self.level.compresses and not self.adaptive:
            return float(self.fixed_bits)
        if not self.bits:
            return None
        num = sum(self.bits[t] * self._dims[t] for t in self.bits)
        return num / sum(self._dims[t] for t in self.bits)

    def report(self) -> dict[str, Any]:
        c = self.compressor
        raw = c.peak_raw_bytes
        out: dict[str, Any] = {
            "gact_level": self.level.value,
            "saved_activation_bytes": c.peak_held_bytes if self.level.compresses else None,
            "raw_saved_activation_bytes": raw if self.level.compresses else None,
            "gact_compression_ratio": (raw / c.peak_held_bytes) if c.peak_held_bytes else None,
            "gact_tensors": len(c.tensors),
            "gact_compressed_tensors": c.last_stats.compressed_tensors,
            "gact_kept_tensors": c.last_stats.kept_tensors,
            "gact_mask_tensors": c.last_stats.mask_tensors,
            "gact_dedup_hits": c.last_stats.dedup_hits,
            "gact_adaptive": self.adaptive,
            "gact_adaptations": self.adaptations,
            "gact_probe_seconds": self.probe_seconds,
            "gact_bits_histogram": {str(k): v for k, v in self.bits_histogram().items()},
            "gact_effective_bits": self.effective_bits(),
            "gact_predicted_variance": self.last_predicted_variance,
            "gact_gradient_variance": self.monitor.variance if self.monitor.observations else None,
        }
        if self.swap is not None:
            out["gact_swapped_bytes"] = self.swap.swapped_bytes
            out["gact_swap_active"] = self.swap.active
        if self.notes:
            out["gact_notes"] = list(self.notes)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "bits": dict(self.bits), "sensitivity": dict(self.sensitivity),
                "dims": dict(self._dims), "adaptations": self.adaptations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.bits = {int(k): int(v) for k, v in state["bits"].items()}
        self.sensitivity = {int(k): float(v) for k, v in state["sensitivity"].items()}
        self._dims = {int(k): int(v) for k, v in state["dims"].items()}
        self.adaptations = int(state["adaptations"])


