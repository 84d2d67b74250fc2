"""ResiReduce-a (Sect. 4.2): one *average* residual per reusable group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_adacc.comm.memories._resireduce import ResiReduceMemory


def uniform_weights(residuals: Sequence[torch.Tensor]) -> list[float]:
    """``w_i = 1``: the shared residual is ``ar_j = (1 / alpha_j) sum_i r_i``."""
    return [1.0] * len(residuals)


class ResiReduceA(ResiReduceMemory):
    """Steps 1-4 of Fig. 5: group, compute every member's residual, store only their average ``ar_j`` and
    compensate every member of the group with it. Memory: one residual per group instead of ``alpha_j``."""

    name = "a"

    def __init__(self, group_size: int = 4):
        super().__init__(group_size=group_size, weighting=uniform_weights)
