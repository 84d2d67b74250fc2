"""Top-k sparsification (Aji & Heafield 2017): send the k entries of largest magnitude."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_adacc.comm.base import Compressor, PayloadSpec


def k_for(numel: int, density: float) -> int:
    """Entries kept for a tensor of ``numel`` elements: ``max(1, ceil(density * numel))``.

    The product is rounded to 6 decimals first so that float fuzz (0.1 * 30 = 3.0000000000000004) does not
    send one entry more than asked."""
    return max(1, min(numel, math.ceil(round(density * numel, 6))))


def check_density(density: float) -> float:
    if not 0.0 < density <= 1.0:
        raise ValueError(
            f"compression density must be in (0, 1], got {density}; e.g. --grad-compress-density 0.01"
        )
    return float(density)


class TopKCompressor(Compressor):
    """Layer-wise Top-k.

    Payload of a tensor with ``n`` elements: ``k = max(1, ceil(density * n))`` values (the tensor's dtype)
    and their flat indices (int32). Ties are broken by ``torch.topk``. The residual it leaves behind is
    the tensor with the sent entries set to zero, exactly.
    """

    name = "topk"

    def __init__(self, density: float = 0.01):
        self.density = check_density(density)

    def layout(self, numel: int, dtype: torch.dtype) -> list[PayloadSpec]:
        if numel >= 2**31:
            raise ValueError(f"top-k indices are int32; a tensor of {numel} elements is too large")
        k = k_for(numel, self.density)
        return [PayloadSpec(dtype, k), PayloadSpec(torch.int32, k)]

    def compress(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.reshape(-1)
        k = k_for(flat.numel(), self.density)
        indices = flat.abs().topk(k, sorted=False).indices
        return [flat[indices], indices.to(torch.int32)]

    def decompress_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor, alpha: float = 1.0) -> None:
        values, indices = payload
        if alpha != 1.0:
            values = values * alpha
        # index_add_ (not index_copy_) so that padded duplicate indices carrying zeros are harmless.
        out.view(-1).index_add_(0, indices.long(), values)
