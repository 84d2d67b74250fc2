"""QSGD (Alistarh et al. 2017): stochastic quantization to ``s`` levels of the tensor's L2 norm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_adacc.comm.base import Compressor, PayloadSpec


class QSGDCompressor(Compressor):
    """QSGD with ``s`` levels.

    For a tensor ``x`` with ``||x||_2 = nrm``: ``l_i = floor(s |x_i| / nrm)`` rounded up with probability
    ``s |x_i| / nrm - l_i`` (so ``E[Q(x)] = x``), sent as ``sign(x_i) l_i`` in int8 (``s <= 127``) plus
    ``nrm`` in the tensor's dtype; decompression is ``nrm / s * sign(x_i) l_i``. The random draws come from
    this compressor's own generator (seeded per rank), saved in checkpoints.
    """

    name = "qsgd"

    def __init__(self, levels: int = 16, seed: int = 0):
        if not 1 <= levels <= 127:
            raise ValueError(
                f"QSGD levels must be in [1, 127] (int8 payload), got {levels}; e.g. --qsgd-levels 16"
            )
        self.levels = int(levels)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def layout(self, numel: int, dtype: torch.dtype) -> list[PayloadSpec]:
        return [PayloadSpec(dtype, 1), PayloadSpec(torch.int8, numel)]

    def compress(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.reshape(-1)
        norm = flat.norm(p=2).reshape(1)
        if norm.item() == 0.0:
            return [norm, torch.zeros(flat.numel(), dtype=torch.int8, device=flat.device)]
        scaled = flat.abs().float() / norm.float() * self.levels
        level = scaled.floor()
        noise = torch.rand(scaled.shape, generator=self.generator).to(scaled.device)
        level += (noise < (scaled - level)).float()
        level.clamp_(max=self.levels)
        return [norm, (level * flat.sign().float()).to(torch.int8)]

    def decompress_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor, alpha: float = 1.0) -> None:
        norm, levels = payload
        scale = norm.to(out.dtype) * (alpha / self.levels)
        out.view(-1).add_(levels.to(out.dtype) * scale)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
