"""Deep Gradient Compression's sparsifier (Lin et al. 2018): a threshold estimated from a random sample."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from megatron_adacc.comm.base import Compressor, PayloadSpec
from megatron_adacc.comm.compressors.topk import check_density, k_for


class DGCCompressor(Compressor):
    """Threshold sparsification with a sampled threshold.

    For a tensor of ``n`` elements and ``k = max(1, ceil(density * n))``:

    1. draw ``m = max(min_sample, ceil(sample_ratio * n))`` entries at random (all entries when ``m >= n``);
    2. the threshold ``thr`` is the ``ceil(density * m)``-th largest magnitude of the sample;
    3. select every entry with ``|g| >= thr``; if more than ``k`` are selected, keep the ``k`` largest of them
       (DGC's hierarchical re-selection), so at most ``k`` entries are sent.

    The payload has the fixed layout of Top-k (``k`` values + ``k`` int32 indices) so that every rank's
    payload has the same size and one all-gather serves a whole bucket; when fewer than ``k`` entries pass
    the threshold the rest is padding (index 0, value 0), which adds nothing on decompression. The sample is
    drawn from this compressor's own generator (seeded per rank), saved in checkpoints.
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
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def layout(self, numel: int, dtype: torch.dtype) -> list[PayloadSpec]:
        k = k_for(numel, self.density)
        return [PayloadSpec(dtype, k), PayloadSpec(torch.int32, k)]

    def sample_indices(self, numel: int) -> torch.Tensor | None:
        """Indices of the sampled entries, or None for "the whole tensor"."""
        m = max(self.min_sample, math.ceil(self.sample_ratio * numel))
        if m >= numel:
            return None
        return torch.randint(0, numel, (m,), generator=self.generator)

    def compress(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = k_for(n, self.density)
        magnitude = flat.abs()
        picked = self.sample_indices(n)
        sample = magnitude if picked is None else magnitude[picked.to(flat.device)]
        k_sample = max(1, min(sample.numel(), math.ceil(self.density * sample.numel())))
        threshold = sample.topk(k_sample, sorted=False).values.min()
        selected = (magnitude >= threshold).nonzero().view(-1)
        if selected.numel() > k:
            selected = selected[magnitude[selected].topk(k, sorted=False).indices]
        values = torch.zeros(k, dtype=flat.dtype, device=flat.device)
        indices = torch.zeros(k, dtype=torch.int32, device=flat.device)
        values[: selected.numel()] = flat[selected]
        indices[: selected.numel()] = selected.to(torch.int32)
        return [values, indices]

    def decompress_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor, alpha: float = 1.0) -> None:
        values, indices = payload
        if alpha != 1.0:
            values = values * alpha
        out.view(-1).index_add_(0, indices.long(), values)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
