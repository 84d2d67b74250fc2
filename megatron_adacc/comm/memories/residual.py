"""Plain error feedback (Sect. 2.2, Fig. 1): one full residual per parameter. The paper's Baseline."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_adacc.comm.base import Memory, ParamSlot


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ResidualMemory(Memory):
    """``G~_t = G_t + R_t`` (compensate), ``R_{t+1} = G~_t - Q^-1(Q(G~_t))`` (update).

    Memory formula: ``sum_i n_i * e`` bytes (``n_i`` elements of parameter ``i``, ``e`` bytes per element of
    the gradient dtype), i.e. one more copy of the gradients.
    """

    name = "residual"

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def register(self, slots: Sequence[ParamSlot], all_slots: Sequence[ParamSlot] | None = None) -> None:
        for slot in slots:
            self.residuals[slot.name] = torch.zeros(slot.shape, dtype=slot.dtype, device=slot.device)

    def compensate(self, tensor: torch.Tensor, name: str) -> None:
        tensor.add_(self.residuals[name])

    def update(self, residual: torch.Tensor, name: str) -> None:
        self.residuals[name].copy_(residual)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {f"param:{name}": r for name, r in self.residuals.items()}

    def formula_bytes(self) -> int:
        return sum(r.numel() * dtype_bytes(r.dtype) for r in self.residuals.values())
