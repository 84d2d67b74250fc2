"""Deep Gradient Compression's sparsifier (Lin et al. 2018): a threshold estimated from a random sample."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from megatron_adacc.comm.base import Compressor, PayloadSpec
from megatron_adacc.comm.compressors._generator import DeviceGenerator
from megatron_adacc.comm.compressors.topk import TopKCompressor, check_density, k_for


class DGCCompressor(Compressor):
    """Threshold sparsification with a sampled threshold.

    For a tensor of ``n`` elements and ``k = max(1, ceil(density * n))``:

    1. draw ``m = max(min_sample, ceil(sample_ratio * n))`` entries at random (all entries when ``m >= n``);
    2. the threshold ``thr`` is the ``ceil(density * m)``-th largest magnitude of the sample;
    3. select every entry with ``|g| >= thr``; if more than ``k`` are selected, keep the ``k`` largest of them
       (DGC's hierarchical re-selection), so at most ``k`` entries are sent.

    The payload has the fixed layout of Top-k (``k`` values + ``k`` int32 indices) so that every rank's
    payload has the same size and one all-gather serves a whole bucket; when fewer than ``k`` entries pass
    the threshold the rest is padding (index 0, value 0), which adds nothing on decompression. Step 3's two
    cases are one computation of fixed size, so the host never reads how many entries pass: the ``k`` largest
    entries, largest first, of which those under the threshold are sent as padding. The sample is drawn from
    this compressor's own generator on the gradient's device (seeded per rank), saved in checkpoints.
    """

    name = "dgc"

    def __init__(
        self, density: float = 0.01, sample_ratio: float = 0.01, min_sample: int = 64, seed: int = 0
    ):
        self.density = check_density(density)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"DGC sample_ratio must be in (0, 1], got {sample_ratio}")
        self.sample_ratio = sample_ratio
        self.min_sample = min_sample
        self.random = DeviceGenerator(seed)

    def layout(self, numel: int, dtype: torch.dtype) -> list[PayloadSpec]:
        k = k_for(numel, self.density)
        return [PayloadSpec(dtype, k), PayloadSpec(torch.int32, k)]

    def sample_indices(self, numel: int, device: torch.device) -> torch.Tensor | None:
        """Indices of the sampled entries (drawn on ``device``), or None for "the whole tensor"."""
        m = max(self.min_sample, math.ceil(self.sample_ratio * numel))
        if m >= numel:
            return None
        return torch.randint(0, numel, (m,), generator=self.random.on(device), device=device)

    def compress(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = k_for(n, self.density)
        magnitude = flat.abs()
        picked = self.sample_indices(n, flat.device)
        sample = magnitude if picked is None else magnitude[picked.to(flat.device)]
        k_sample = max(1, min(sample.numel(), math.ceil(self.density * sample.numel())))
        threshold = sample.topk(k_sample, sorted=False).values.min()
        top = magnitude.topk(k)  # more than k pass: these k; fewer: all that pass come first
        passes = top.values >= threshold
        values = torch.where(passes, flat[top.indices], 0)
        indices = torch.where(passes, top.indices, 0).to(torch.int32)
        return [values, indices]

    def for_owner(self) -> TopKCompressor:
        """Top-k's (:meth:`TopKCompressor.for_owner`): the owner selects among at most ``N k`` entries, where a
        sampled threshold saves nothing."""
        return TopKCompressor(self.density).for_owner()

    def decompress_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor, alpha: float = 1.0) -> None:
        values, indices = payload
        if alpha != 1.0:
            values = values * alpha
        out.view(-1).index_add_(0, indices.long(), values)

    def state_dict(self) -> dict[str, Any]:
        return self.random.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.random.load_state_dict(state)
