"""The GACT controller: one object that compresses a model's saved tensors and adapts their bit widths.

Plain PyTorch::

    ctl = gact.Controller(model, level="L1")          # 4 bits per value on average
    for x, y in loader:
        loss = ctl.step(lambda: train_step(x, y))       # train_step runs forward + backward, returns the loss
        optimizer.step(); optimizer.zero_grad()

``step(fn)`` re-estimates the sensitivities every ``adapt_interval`` iterations (Algorithm 1 runs ``fn``
``L + 2`` extra times with the gradients discarded), runs ``fn`` with the hooks installed, and feeds the
resulting gradients to the variance monitor. For manual control, ``with ctl:`` installs the hooks around any
forward (+ backward), ``ctl.adapt(fn)`` runs the estimation, ``ctl.observe_gradients()`` the monitor.

The controller is a facade: the saved-tensor hooks (:mod:`~megatron_adacc.gact.hooks`) ask it for each
tensor's bits and seed, and it answers from the sensitivity probe (:mod:`~megatron_adacc.gact.probe`) while
one runs, else from the bit allocator (:mod:`~megatron_adacc.gact.allocator`). It changes nothing in the model:
CB1/CB2's Megatron-side changes (full recompute, memory-efficient attention) belong to GACT's training
extension (:func:`megatron_adacc.gact.extension.apply_level_effects`), so this module never imports Megatron.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Self

import torch

from megatron_adacc.gact.allocation import BIT_LEVELS
from megatron_adacc.gact.allocator import BitAllocator
from megatron_adacc.gact.hooks import CodecFactory, SavedTensorCompressor, mix_seed
from megatron_adacc.gact.levels import Level
from megatron_adacc.gact.monitor import GactVarianceWarning, GradientVarianceMonitor
from megatron_adacc.gact.probe import SensitivityProbe
from megatron_adacc.gact.swap import SwapManager

log = logging.getLogger(__name__)

__all__ = ["Controller", "GactVarianceWarning"]  # the warning lived here; kept importable from this module


def _as_modules(model: Any) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    mods = list(model)
    if not mods or not all(isinstance(m, torch.nn.Module) for m in mods):
        raise TypeError("Controller(model=...) takes a torch.nn.Module or a list of them (model chunks)")
    return mods


def _check_recompute_is_on(level: Level, modules: list[torch.nn.Module]) -> None:
    """CB1/CB2 only add compression of what megatron-core's full recompute saves; switching that recompute on
    is the extension's job. Checking it here keeps a CB level on an unprepared model from silently running as
    L1. Duck-typed on the config, so no Megatron import is needed."""
    if not level.recomputes:
        return
    for m in modules:
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(cfg, "recompute_granularity"):
            what = "has no megatron TransformerConfig"
        elif cfg.recompute_granularity != "full":
            what = f"runs recompute_granularity={cfg.recompute_granularity!r}, not full recompute"
        else:
            continue
        raise ValueError(
            f"GACT {level.value} compresses the layer inputs saved by megatron-core's full recompute, but "
            f"{type(m).__name__} {what}. With a megatron-core model use GactExtension (adacc train "
            f"--gact-level {level.value}), or call megatron_adacc.gact.extension.apply_level_effects("
            f"{level.value!r}, model) before building the Controller. For a plain torch model use L1 and wrap "
            "segments in torch.utils.checkpoint.checkpoint(..., use_reentrant=True): the segment inputs it "
            "saves are then compressed by the L1 hooks.")


class Controller:
    """Activation-compressed training for any torch model (GACT, Table 1 levels).

    Args:
        model: the module (or list of model chunks) being trained.
        level: ``"L0"`` (off), ``"L1"``, ``"L2"``, ``"CB1"``, ``"CB2"``. CB1/CB2 need a megatron-core model
            already switched to full recompute (see :func:`_check_recompute_is_on`).
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
        variance_momentum: EMA momentum of the gradient-variance monitor.
        min_numel: float tensors smaller than this stay uncompressed (default: one group).
        codec_factory: ``get_codec``-compatible factory (default ``megatron_adacc.codecs.get_codec``).
        levels: the bit widths the allocation chooses from (32 = keep the tensor uncompressed).
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
        self.allocator = BitAllocator(bits, levels, adaptive)
        if adapt_interval < 1:
            raise ValueError(f"adapt_interval must be >= 1, got {adapt_interval}")
        default_probe_bits = min(self.allocator.fixed_bits, 8)
        self.probe = SensitivityProbe(default_probe_bits if probe_bits is None else probe_bits, probe_repeats)
        _check_recompute_is_on(self.level, self.modules)
        self.group_size = group_size
        self.adapt_interval = adapt_interval
        self.seed = seed
        self.warn_ratio = warn_ratio
        self.warmup = warmup
        self.iteration = 0
        self.monitor = GradientVarianceMonitor(variance_momentum)
        self.adaptations = 0
        self.microbatches_per_step = 1
        self.notes: list[str] = []
        """Lines for the report about what a host changed in the model for this level (the extension's)."""
        self._entered: list[AbstractContextManager] = []

        self.swap = SwapManager(self._device()) if self.level.swaps else None
        self.compressor = SavedTensorCompressor(
            self._model_tensors, group_size, self._bits_for, self._seed_for,
            codec_factory=codec_factory, min_numel=min_numel, swap=self.swap,
        )

    # ------------------------------------------------------------------ what the parts hold
    @property
    def adaptive(self) -> bool:
        return self.allocator.adaptive

    @property
    def bits(self) -> dict[int, int]:
        """The current allocation: bits per saved tensor id."""
        return self.allocator.bits

    @property
    def sensitivity(self) -> dict[int, float]:
        """``c_l`` per saved tensor id from the last adaptation."""
        return self.allocator.sensitivity

    @property
    def fixed_bits(self) -> int:
        return self.allocator.fixed_bits

    @property
    def probe_bits(self) -> int:
        return self.probe.bits

    @property
    def probe_seconds(self) -> float:
        return self.probe.seconds

    @property
    def probe_noise_floor(self) -> float:
        return self.probe.noise_floor

    @property
    def last_predicted_variance(self) -> float | None:
        return self.allocator.predicted_variance

    @property
    def parameters(self) -> list[torch.Tensor]:
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ answers to the hooks
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

    def _bits_for(self, tensor_id: int, numel: int) -> int:
        if self.probe.active:
            return self.probe.bits_for(tensor_id, numel)
        return self.allocator.bits_for(tensor_id, numel)

    def _seed_for(self, tensor_id: int) -> int:
        if self.probe.active:
            return self.probe.seed_for(tensor_id)
        return mix_seed(self.seed, self.compressor.passes, tensor_id)  # fresh seeds every pass

    # ------------------------------------------------------------------ hooks
    def hooks(self) -> AbstractContextManager:
        """Context manager installing the saved-tensor hooks for one forward + backward (no-op at L0)."""
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

    def estimate_sensitivity(self, forward_backward: Callable[[], Any]) -> dict[int, float]:
        """``c_l`` for every saved tensor (Algorithm 1, see :class:`SensitivityProbe`); ``L + 2`` evaluations
        of ``forward_backward`` per repeat, gradients left zeroed, every RNG restored."""
        est = self.probe.estimate(forward_backward, self.compressor, self.parameters, self.seed, self.adaptations)
        self.allocator.dims.update(self.probe.dims)
        return est

    def adapt(self, forward_backward: Callable[[], Any]) -> dict[int, int]:
        """Re-estimate sensitivities and re-allocate bits (greedy, budget ``bits`` on average)."""
        start = time.perf_counter()
        bits = self.allocator.allocate(self.estimate_sensitivity(forward_backward))
        self.adaptations += 1
        self.monitor.check(self.allocator.predicted_variance, self.microbatches_per_step, self.warn_ratio,
                           self.warmup, stacklevel=2)
        log.info("GACT: adapted %d tensors in %.2fs: %s", len(bits), time.perf_counter() - start,
                 self.bits_histogram())
        return bits

    # ------------------------------------------------------------------ reporting
    def bits_histogram(self) -> dict[int, int]:
        return self.allocator.histogram()

    def effective_bits(self) -> float | None:
        """Average bits per value over all tracked tensors, weighted by size (the budget's measure)."""
        if self.level.compresses and not self.adaptive:
            return float(self.allocator.fixed_bits)
        return self.allocator.mean_bits()

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
            "gact_probe_seconds": self.probe.seconds,
            "gact_bits_histogram": {str(k): v for k, v in self.bits_histogram().items()},
            "gact_effective_bits": self.effective_bits(),
            "gact_predicted_variance": self.allocator.predicted_variance,
            "gact_gradient_variance": self.monitor.variance if self.monitor.observations else None,
        }
        if self.swap is not None:
            out["gact_swapped_bytes"] = self.swap.swapped_bytes
            out["gact_swap_active"] = self.swap.active
        if self.notes:
            out["gact_notes"] = list(self.notes)
        return out

    def state_dict(self) -> dict[str, Any]:
        # The pass count seeds the stochastic rounding of every later pass; the monitor's moving averages feed
        # the variance check: a resumed run needs both to continue as the straight one does.
        return {"iteration": self.iteration, **self.allocator.state_dict(), "adaptations": self.adaptations,
                "passes": self.compressor.passes, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.allocator.load_state_dict(state)
        self.adaptations = int(state["adaptations"])
        if "passes" in state:  # absent from checkpoints written before it was saved
            self.compressor.passes = int(state["passes"])
            self.monitor.load_state_dict(state["monitor"])
