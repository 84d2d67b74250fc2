"""GACT's sensitivity probe (Algorithm 1): how much each saved tensor's compression noise moves the gradient.

For every saved tensor ``l`` the probe compares two gradient evaluations that differ *only* in the seed of
``l``'s compressor: ``c_l = 0.5 ||g0 - g1||^2 / S(b)``, with every tensor compressed at the probe's bit width
``b``. ``g0`` is shared by all tensors, so one repeat costs ``L + 1`` evaluations, plus one that re-runs ``g0``
unchanged to prove the evaluation is repeatable.

While :meth:`SensitivityProbe.estimate` runs, the compressor must take its bits and seeds from the probe
(:meth:`~SensitivityProbe.bits_for`, :meth:`~SensitivityProbe.seed_for`, gated by
:attr:`~SensitivityProbe.active`): the controller routes them. The probe discards the gradients it produces,
puts every RNG back where it was and keeps its passes out of the compressor's memory figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_adacc.gact.allocation import KEEP_BITS, variance_factor
from megatron_adacc.gact.hooks import mix_seed
from megatron_adacc.gact.sensitivity import (
    frozen_rng,
    snapshot_gradients,
    squared_distance_inplace,
    zero_gradients,
)

#: One gradient evaluation with the given (seed base, perturbed tensor id or -1); returns how many tensors
#: the pass numbered.
Evaluate = Callable[[int, int], int]


class SensitivityProbe:
    """Per-tensor sensitivities ``c_l`` of one model, re-estimated on demand.

    Args:
        bits: bit width at which every tensor is compressed while probing (below 32: an uncompressed tensor
            has no variance to measure).
        repeats: seed pairs averaged per tensor (Algorithm 1 uses one).
    """

    def __init__(self, bits: int, repeats: int = 1):
        if repeats < 1:
            raise ValueError(f"probe_repeats must be >= 1, got {repeats}")
        if bits >= KEEP_BITS:
            raise ValueError("probe_bits must be below 32: an uncompressed tensor has no variance to measure")
        self.bits = int(bits)
        self.repeats = repeats
        self.dims: dict[int, int] = {}
        """Values per saved tensor, as numbered by the last estimate's passes."""
        self.noise_floor = 0.0
        """Squared distance between two evaluations with identical seeds in the last repeat (0 when exact)."""
        self.seconds = 0.0
        """Wall time spent in :meth:`estimate`, summed over calls."""
        self._seeds: tuple[int, int] | None = None  # (seed base, perturbed tensor id or -1) while evaluating
        self._numbered = 0

    @property
    def active(self) -> bool:
        """True during a probe evaluation: bits and seeds must come from this probe."""
        return self._seeds is not None

    def bits_for(self, tensor_id: int, numel: int) -> int:
        # The hooks ask once per tensor they number, so this also counts the pass's tensors and sizes.
        self._numbered = max(self._numbered, tensor_id + 1)
        self.dims[tensor_id] = numel
        return self.bits

    def seed_for(self, tensor_id: int) -> int:
        if self._seeds is None:
            raise RuntimeError("SensitivityProbe.seed_for called outside estimate()")
        base, perturbed = self._seeds
        # Algorithm 1: seeds r_1..r_L fixed; the perturbed tensor gets r_{L+1} instead.
        return mix_seed(base, tensor_id, 1 if tensor_id == perturbed else 0)

    def estimate(self, forward_backward: Callable[[], Any], compressor: Any, params: Sequence[torch.Tensor],
                 seed: int = 0, round_: int = 0) -> dict[int, float]:
        """``c_l`` for every tensor ``compressor`` numbers while ``forward_backward`` runs.

        ``compressor`` is the :class:`~megatron_adacc.gact.hooks.SavedTensorCompressor` whose bits and seeds
        come from this probe; ``params`` are the parameters whose gradients are compared; ``seed`` and
        ``round_`` (the adaptation count) pick the probe's seeds. ``forward_backward`` must replay one batch
        deterministically. Gradients are left zeroed and every RNG is restored afterwards."""
        start = time.perf_counter()
        sums: dict[int, float] = {}
        self.dims = {}
        compressor.recording = False
        with frozen_rng() as reset_rng:

            def evaluate(base: int, perturbed: int) -> int:
                self._seeds = (base, perturbed)
                self._numbered = 0
                zero_gradients(params)
                reset_rng()  # dropout masks repeat, so only the compressor seeds differ
                with compressor.pass_context():
                    forward_backward()
                return self._numbered

            try:
                for rep in range(self.repeats):
                    self._repeat(evaluate, params, mix_seed(seed, 0x5EED, round_, rep), sums, rep + 1)
            finally:
                self._seeds = None
                compressor.recording = True
                zero_gradients(params)
        self.seconds += time.perf_counter() - start
        return {tid: s / self.repeats for tid, s in sums.items()}

    def _repeat(self, evaluate: Evaluate, params: Sequence[torch.Tensor], base: int, sums: dict[int, float],
                reps: int) -> None:
        """One seed pair per tensor, added to ``sums``; ``reps`` counts the repeats done including this one."""
        factor = variance_factor(self.bits)
        n_tensors = evaluate(base, -1)
        ref = snapshot_gradients(params)  # g0: the only gradient copy the probe holds
        evaluate(base, -1)
        control = squared_distance_inplace(params, ref)
        for tid in range(n_tensors):
            numbered = evaluate(base, tid)
            if numbered != n_tensors:
                raise RuntimeError(
                    "GACT sensitivity probe: the model saved a different number of tensors in "
                    f"two identical passes ({n_tensors} vs {numbered}); the "
                    "forward must be deterministic for the probe (same batch, same branches)")
            dist = squared_distance_inplace(params, ref)
            # Subtracting the control removes what the evaluation's own non-determinism contributes.
            sums[tid] = sums.get(tid, 0.0) + 0.5 * max(dist - control, 0.0) / factor
        self._check_repeatable(control, sums, reps)

    def _check_repeatable(self, control: float, sums: dict[int, float], reps: int) -> None:
        """Algorithm 1 needs two gradient evaluations that differ *only* in one compressor's seed. If two
        evaluations with identical seeds already differ by as much as the perturbed ones, the probe function
        is not replaying one batch (or the kernels are non-deterministic) and every estimate is noise."""
        self.noise_floor = control
        if control == 0.0:
            return
        typical = sorted(sums.values())[len(sums) // 2] * 2 * variance_factor(self.bits) / reps
        if control > 0.1 * typical:
            raise RuntimeError(
                "GACT sensitivity probe: two evaluations with identical compressor seeds gave gradients "
                f"{control:.3e} apart (squared), comparable to the seed-perturbed ones ({typical:.3e}). The "
                "forward_backward passed to the controller must replay the same batch every call (and run "
                "deterministically); a function drawing a fresh batch per call cannot measure sensitivity.")
