"""Measure how many gradient bytes are alive at once during backward (allocator-independent).

RSS on CPU lies about freed buffers (see the measuring-on-cpu research note), so AdamA's claim "gradients
are released as soon as they are folded" is checked directly: at every post-accumulate-grad hook the meter
keeps a weak reference to the parameter's new gradient and sums the bytes of all gradients still alive.
A weak reference dies only when the tensor itself is freed, so a gradient that was merely unlinked from
``.grad`` but is still referenced elsewhere keeps counting.

Register the meter *before* the optimizer's hooks (hooks run in registration order) so it sees every
gradient before AdamA releases it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from megatron_adacc.core.saved import unique_storage_bytes

__all__ = ["LiveGradientMeter"]


class LiveGradientMeter:
    """Peak bytes of simultaneously alive gradient tensors, sampled at each parameter's gradient arrival."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._refs: dict[int, weakref.ref] = {}
        self.peak_bytes = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in params if p.requires_grad]

    def _on_grad(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        self._refs[id(p)] = weakref.ref(g)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def live_bytes(self) -> int:
        """Bytes of the gradients seen so far that are still alive now (gradients viewing one buffer count it
        once)."""
        return unique_storage_bytes(ref() for ref in self._refs.values())

    def reset(self) -> None:
        self._refs.clear()
        self.peak_bytes = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
