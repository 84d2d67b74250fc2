"""ResiReduce-(w+2d) (Sect. 5.1): the paper's final scheme, weighted group reuse plus 2-D compression."""

from __future__ import annotations

from functools import partial

from megatron_adacc.comm.memories._resireduce import ResiReduceMemory
from megatron_adacc.comm.memories.resireduce_2d import RowColumnSelection
from megatron_adacc.comm.memories.resireduce_w import significance_weights


class ResiReduceW2D(ResiReduceMemory):
    """Reusable groups share a significance-weighted residual (ResiReduce-w); specific layers keep the
    crossing of their top-L1 rows and columns (ResiReduce-2d); the rest keep full residuals."""

    name = "w+2d"

    def __init__(self, group_size: int = 4, phi: float = 0.5, ratio: float = 0.5):
        if not 0.0 <= phi <= 1.0:
            raise ValueError(f"ResiReduce-w phi must be in [0, 1], got {phi}; e.g. --resireduce-phi 0.5")
        self.phi = phi
        super().__init__(
            group_size=group_size,
            weighting=partial(significance_weights, phi=phi),
            intra=RowColumnSelection(ratio),
        )
