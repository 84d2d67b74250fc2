"""GACT's a-posteriori failure check (section 4.2): is compression noise large next to the gradient's own?

:class:`GradientVarianceMonitor` keeps a running estimate of the step gradient's variance; after each
adaptation the allocator's predicted compression variance ``sum_l c_l S(b_l)`` is compared with it and
:class:`GactVarianceWarning` fires when compression would dominate.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_adacc.gact.sensitivity import gradient_of


class GactVarianceWarning(UserWarning):
    """The predicted compression variance is large next to the gradient's own variance: raise the bits."""


class GradientVarianceMonitor:
    """Running estimate of the gradient's variance across steps, ``E||g - E g||^2``.

    Bias-corrected exponential moving averages of the gradient (one buffer per parameter) and of
    ``||g - mean||^2``, as GACT's a-posteriori failure check does. The second stays on the gradients' device
    (float64, the same arithmetic as Python floats): :meth:`update` runs at every step and reads nothing, and
    :attr:`variance` is read only when an adaptation checks it.
    """

    def __init__(self, momentum: float = 0.9):
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"variance momentum must be in (0, 1), got {momentum}")
        self.momentum = momentum
        self._mean: list[torch.Tensor | None] = []
        self._corr = 0.0
        self._var: float | torch.Tensor = 0.0
        self.observations = 0

    def update(self, params: Sequence[torch.Tensor]) -> None:
        grads = [gradient_of(p) for p in params]
        if all(g is None for g in grads):
            return
        m = self.momentum
        if not self._mean:
            self._mean = [None] * len(params)
        self._corr = self._corr * m + (1 - m)
        dist: float | torch.Tensor = 0.0
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.detach()
            if self._mean[i] is None:
                self._mean[i] = torch.zeros_like(g, dtype=torch.float32)
            buf = self._mean[i]
            buf.mul_(m).add_(g.float(), alpha=1 - m)
            dist = dist + torch.linalg.vector_norm(buf / self._corr - g.float(), dtype=torch.float64) ** 2
        self._var = self._var * m + (1 - m) * dist
        self.observations += 1

    def state_dict(self) -> dict[str, Any]:
        return {"mean": [None if b is None else b.clone() for b in self._mean], "corr": self._corr,
                "var": float(self._var), "observations": self.observations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._mean = [None if b is None else b.clone() for b in state["mean"]]
        self._corr, self._var = float(state["corr"]), float(state["var"])
        self.observations = int(state["observations"])

    @property
    def variance(self) -> float:
        """The estimate (reads it from the device)."""
        return float(self._var) / self._corr if self._corr else 0.0

    def check(self, predicted: float | None, microbatches_per_step: int, warn_ratio: float, warmup: int,
              stacklevel: int = 2) -> None:
        """Warn when ``predicted`` (one micro-batch's compression variance) exceeds ``warn_ratio`` times the
        gradient variance; silent before ``warmup`` observations, when the estimate is still unreliable.
        ``stacklevel`` counts like :func:`warnings.warn`'s from the caller of this method (2: its caller)."""
        if predicted is None or self.observations < warmup:
            return
        # The probe measures one micro-batch's gradient; a step averages ``microbatches_per_step`` of them
        # with independent compressor seeds, which divides the compression variance by that count.
        v = predicted / microbatches_per_step
        gvar = self.variance
        if v > warn_ratio * gvar:
            warnings.warn(
                f"GACT: predicted compression variance {v:.3e} exceeds {warn_ratio} x the gradient "
                f"variance {gvar:.3e}; training may suffer. Raise the bits budget (--gact-bits).",
                GactVarianceWarning, stacklevel=stacklevel + 1)
