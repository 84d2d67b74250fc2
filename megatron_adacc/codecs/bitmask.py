"""1-bit packing of dropout masks: lossless and 8x smaller than a bool/uint8 mask."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_adacc.codecs.base import Codec, Packed


class BitmaskCodec(Codec):
    """Packs a bool or 0/1 uint8 tensor to one bit per value (little-endian within each byte).

    Size: ``ceil(n / 8)`` bytes. A uint8 value other than 0 or 1 raises `ValueError`, because packing it
    to one bit would not be lossless (the packing pass finds it; reading its answer is a host sync on a GPU,
    so a bool mask, which holds nothing else, is packed without one: what the training hooks pass).
    """

    name = "bitmask"
    lossless = True

    def __init__(self, *, kernels: Any) -> None:
        self._k = kernels

    def compress(self, x: torch.Tensor) -> Packed:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"bitmask codec expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.bool, torch.uint8):
            raise TypeError(
                f"bitmask codec packs bool or uint8 0/1 masks, got {x.dtype}; use a quantizing codec "
                "or 'keep' for this tensor"
            )
        x = x.detach()
        payload, bad = self._k.bitmask_pack(x.contiguous().view(-1))
        if x.dtype == torch.uint8 and int(bad.item()):
            raise ValueError(
                "bitmask codec: the uint8 mask holds values other than 0 and 1, which one bit cannot "
                "store losslessly; pass a bool mask or use the 'keep' codec"
            )
        return Packed(self.name, x.shape, x.dtype, x.device, {"payload": payload})

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        out = torch.empty(p.numel, dtype=p.dtype, device=p.device)
        self._k.bitmask_unpack(p.tensors["payload"], out)
        return out.view(p.shape)

    def compressed_nbytes(self, shape, dtype, **data_dependent: Any) -> int:  # noqa: ANN001
        return -(-math.prod(shape) // 8)
