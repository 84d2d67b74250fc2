"""Identity "compressor": sends the tensor as it is (the control case of the pipeline)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_adacc.comm.base import Compressor, PayloadSpec


class NoneCompressor(Compressor):
    """Payload = the dense tensor. Linear and position-aligned, so the communicator all-reduces it."""

    name = "none"
    supports_allreduce = True

    def layout(self, numel: int, dtype: torch.dtype) -> list[PayloadSpec]:
        return [PayloadSpec(dtype, numel)]

    def compress(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.reshape(-1).clone()]

    def decompress_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor, alpha: float = 1.0) -> None:
        out.view(-1).add_(payload[0], alpha=alpha)
