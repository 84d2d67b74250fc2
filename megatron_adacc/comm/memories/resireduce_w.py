"""ResiReduce-w (Sect. 4.2): one *weighted* average residual per reusable group."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch

from megatron_adacc.comm.memories._resireduce import ResiReduceMemory


def significance_weights(residuals: Sequence[torch.Tensor], phi: float = 0.5) -> list[torch.Tensor]:
    """``w_i = phi ||r_i||_1 / n_i + (1 - phi) ||r_i||_2 / sqrt(n_i)`` (``n_i`` elements of ``r_i``), as 0-d
    float64 tensors on the residuals' device: they are only used there, so nothing is read on the host."""
    weights = []
    for r in residuals:
        n = r.numel()
        # vector_norm reduces without materializing |r| or a float64 copy of a layer-sized residual.
        l1 = torch.linalg.vector_norm(r, ord=1).double()
        l2 = torch.linalg.vector_norm(r, ord=2).double()
        weights.append(phi * l1 / n + (1.0 - phi) * l2 / math.sqrt(n))
    return weights


class ResiReduceW(ResiReduceMemory):
    """The shared residual of group ``j`` is ``war_j = sum_i w_i r_i / sum_i w_i`` with the significance
    weights above (``phi = 0.5`` by default), so members with larger residuals count more."""

    name = "w"

    def __init__(self, group_size: int = 4, phi: float = 0.5):
        if not 0.0 <= phi <= 1.0:
            raise ValueError(f"ResiReduce-w phi must be in [0, 1], got {phi}; e.g. --resireduce-phi 0.5")
        self.phi = phi
        super().__init__(group_size=group_size, weighting=partial(significance_weights, phi=phi))
