"""ResiReduce-d (Sect. 4.3): keep the rows of a specific layer's residual with the largest L1 norms."""

from __future__ import annotations

import torch

from megatron_adacc.comm.memories._resireduce import INDEX_DTYPE, IntraLayerScheme, ResiReduceMemory, check_ratio, kept
from megatron_adacc.comm.memories.residual import dtype_bytes


class RowSelection(IntraLayerScheme):
    """Dimension-wise compression: of an ``R x C`` residual keep ``k = max(1, floor(ratio R))`` rows, those
    with the largest ``||r_row||_1``. Stores ``k x C`` values and ``k`` int64 row indices:
    ``k C e + 8 k`` bytes."""

    name = "d"

    def __init__(self, ratio: float = 0.5):
        self.ratio = check_ratio(ratio)

    def allocate(
        self, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, torch.Tensor]:
        k = kept(rows, self.ratio)
        return {
            "rows": torch.arange(k, dtype=INDEX_DTYPE, device=device),
            "values": torch.zeros(k, cols, dtype=dtype, device=device),
        }

    def compensate(self, tensor2d: torch.Tensor, store: dict[str, torch.Tensor]) -> None:
        tensor2d.index_add_(0, store["rows"], store["values"])

    def update(self, residual2d: torch.Tensor, store: dict[str, torch.Tensor]) -> None:
        k = store["rows"].numel()
        rows = residual2d.abs().sum(dim=1).topk(k).indices.sort().values
        store["rows"].copy_(rows)
        torch.index_select(residual2d, 0, rows, out=store["values"])

    def formula_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        k = kept(rows, self.ratio)
        return k * cols * dtype_bytes(dtype) + k * 8


class ResiReduceD(ResiReduceMemory):
    """Specific layers keep only their top-L1 rows; every other parameter keeps a full residual."""

    name = "d"

    def __init__(self, ratio: float = 0.5):
        super().__init__(intra=RowSelection(ratio))
