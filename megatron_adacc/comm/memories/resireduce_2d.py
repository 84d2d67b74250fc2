"""ResiReduce-2d (Sect. 4.3): keep the overlap of the top-L1 rows and top-L1 columns of a specific layer."""

from __future__ import annotations

import torch

from megatron_adacc.comm.memories._resireduce import INDEX_DTYPE, IntraLayerScheme, ResiReduceMemory, check_ratio, kept
from megatron_adacc.comm.memories.residual import dtype_bytes


class RowColumnSelection(IntraLayerScheme):
    """Two-dimension compression: of an ``R x C`` residual select ``k_r = max(1, floor(ratio R))`` rows with
    the largest row L1 norms and ``k_c = max(1, floor(ratio C))`` columns with the largest column L1 norms,
    and keep the ``k_r x k_c`` elements where they cross (Fig. 7c: 4 of 8 rows, 3 of 6 columns, 12 of 48
    elements). Stores ``k_r k_c e + 8 (k_r + k_c)`` bytes."""

    name = "2d"

    def __init__(self, ratio: float = 0.5):
        self.ratio = check_ratio(ratio)

    def allocate(
        self, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, torch.Tensor]:
        kr, kc = kept(rows, self.ratio), kept(cols, self.ratio)
        return {
            "rows": torch.arange(kr, dtype=INDEX_DTYPE, device=device),
            "cols": torch.arange(kc, dtype=INDEX_DTYPE, device=device),
            "values": torch.zeros(kr, kc, dtype=dtype, device=device),
        }

    def compensate(self, tensor2d: torch.Tensor, store: dict[str, torch.Tensor]) -> None:
        tensor2d.index_put_(
            (store["rows"].unsqueeze(1), store["cols"].unsqueeze(0)), store["values"], accumulate=True
        )

    def update(self, residual2d: torch.Tensor, store: dict[str, torch.Tensor]) -> None:
        magnitude = residual2d.abs()
        rows = magnitude.sum(dim=1).topk(store["rows"].numel()).indices.sort().values
        cols = magnitude.sum(dim=0).topk(store["cols"].numel()).indices.sort().values
        store["rows"].copy_(rows)
        store["cols"].copy_(cols)
        store["values"].copy_(residual2d[rows.unsqueeze(1), cols.unsqueeze(0)])

    def formula_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        kr, kc = kept(rows, self.ratio), kept(cols, self.ratio)
        return kr * kc * dtype_bytes(dtype) + 8 * (kr + kc)


class ResiReduce2D(ResiReduceMemory):
    """Specific layers keep the crossing of their top-L1 rows and columns; others keep a full residual."""

    name = "2d"

    def __init__(self, ratio: float = 0.5):
        super().__init__(intra=RowColumnSelection(ratio))
