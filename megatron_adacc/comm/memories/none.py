"""No error feedback: the compression error is dropped (ablation; Sect. 2.2 without Steps 2 and 5)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_adacc.comm.base import Memory, ParamSlot


class NoneMemory(Memory):
    """Stores nothing; compensate and update do nothing. Residual memory formula: 0 bytes."""

    name = "none"

    def register(self, slots: Sequence[ParamSlot], all_slots: Sequence[ParamSlot] | None = None) -> None:
        pass

    def compensate(self, tensor: torch.Tensor, name: str) -> None:
        pass

    def update(self, residual: torch.Tensor, name: str) -> None:
        pass

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def formula_bytes(self) -> int:
        return 0
