"""The random stream of a stochastic compressor (``dgc``, ``qsgd``): on the gradients' device, saved in checkpoints.

Drawing on the device keeps both the draw and its use there. A CPU generator's draw would have to be copied to
the device, and a copy from pageable host memory makes the host wait for the device first (a sync at every
compressed tensor).
"""

from __future__ import annotations

from typing import Any

import torch


class DeviceGenerator:
    """A ``torch.Generator`` seeded with ``seed``, made on the device of the first tensor it draws for."""

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self._generator: torch.Generator | None = None
        self._loaded: tuple[str, torch.Tensor] | None = None  # a checkpoint's state, for the generator to come

    def on(self, device: torch.device) -> torch.Generator:
        """The generator for tensors on ``device`` (made, seeded and given any loaded state, at its first use)."""
        gen = self._generator
        if gen is not None and _same(gen.device, device):
            return gen
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        if self._loaded is not None:
            where, state = self._loaded
            if torch.device(where).type != torch.device(device).type:
                raise ValueError(f"this compressor's random state was saved on {where}; resume on a {where} "
                                 f"device (gradients are on {device})")
            gen.set_state(state)
            self._loaded = None
        self._generator = gen
        return gen

    def state_dict(self) -> dict[str, Any]:
        """The generator's state and device (a state loaded and not yet used, if no draw was made since)."""
        if self._generator is not None:
            return {"generator": self._generator.get_state(), "device": str(self._generator.device)}
        if self._loaded is not None:
            return {"generator": self._loaded[1], "device": self._loaded[0]}
        return {"generator": None, "device": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint without ``device`` was made on the CPU)."""
        if state.get("generator") is None:
            return
        self._loaded = (state.get("device") or "cpu", state["generator"])
        if self._generator is not None:
            device = self._generator.device
            self._generator = None
            self.on(device)


def _same(a: torch.device, b: torch.device) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)
