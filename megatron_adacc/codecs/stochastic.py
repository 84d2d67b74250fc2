"""GACT's per-group min/max quantizer with stochastic rounding (seed 003, section 4 and appendix A.4)."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_adacc.codecs.base import Codec, Packed, check_float_input, mark_nonfinite, packed_group_bytes

SUPPORTED_BITS = (1, 2, 4, 8)


class StochasticCodec(Codec):
    """Per-group quantizer of ActNN/GACT: ``T = (2**b - 1) (x - min) / (max - min)``, rounded up with
    probability ``T - floor(T)``, so ``E[x_hat] = x`` (unbiased) and ``Var[x_hat] <= S**2 / 4`` with
    ``S = (max - min) / (2**b - 1)`` (GACT's ``R(h) S(b)`` bound).

    Groups are ``group_size`` consecutive values of the flattened tensor. Kept per group: float32 min and
    scale; codes are ``bits`` wide, packed per group from a byte boundary. Size:
    ``sum over groups of ceil(len * bits / 8) + 8 * ceil(n / group_size)``.

    Randomness: one seed per call feeds a counter-based hash of each element's index, so the random stream is
    identical on CPU, CUDA and in the reference, whatever the thread count. The seed is a kernel argument, a
    number on the host: ``seed`` when given (GACT derives one per tensor and iteration), else one drawn on the
    host from ``generator`` (a CPU generator; torch's default one when None, so ``torch.manual_seed`` makes it
    reproducible). No device value is read: a CUDA generator's draw would have to be (a sync on every call),
    so it is refused. Uniforms have 24 bits, so the rounding probability is within ``2**-24`` of ``frac(T)``.

    Extremes: a range ``max - min`` beyond float32 (values of both signs past about 1.7e38) is worked out
    at a quarter of the values, so ``S`` is still the float32 value of ``range / (2**b - 1)`` and no code
    or decoded value overflows. With 1 bit that ``S`` is the range itself, which float32 cannot hold: it
    saturates at ``finfo.max``, and values above ``min + finfo.max`` round down to that level, so such a
    group is within one step (of its true range) but no longer unbiased.
    """

    name = "stochastic"

    def __init__(self, bits: int = 4, group_size: int = 256, *, kernels: Any) -> None:
        if bits not in SUPPORTED_BITS or isinstance(bits, bool):
            raise ValueError(f"stochastic codec: bits must be one of {SUPPORTED_BITS}, got {bits!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"stochastic codec: group_size must be a positive int, got {group_size!r}")
        self.bits = bits
        self.group_size = group_size
        self._k = kernels

    def params(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size}

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None, seed: int | None = None) -> Packed:
        check_float_input(self.name, x)
        x = x.detach()
        if seed is None:
            seed = draw_seed(generator)
        payload, mins, scales, bad = self._k.stochastic_compress(
            x.contiguous().view(-1), self.group_size, self.bits, int(seed)
        )
        tensors = {"payload": payload, "mins": mins, "scales": scales}
        meta = {"group": self.group_size, "bits": self.bits, "seed": int(seed)}
        return Packed(self.name, x.shape, x.dtype, x.device, tensors, meta, {"nonfinite": bad})

    def decompress(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        out = torch.empty(p.numel, dtype=p.dtype, device=p.device)
        t = p.tensors
        self._k.stochastic_decompress(t["payload"], t["mins"], t["scales"], p.meta["group"], p.meta["bits"], out)
        return mark_nonfinite(out, p.nonfinite).view(p.shape)

    def compressed_nbytes(self, shape, dtype, **data_dependent: Any) -> int:  # noqa: ANN001
        n = math.prod(shape)
        return packed_group_bytes(n, self.group_size, self.bits) + 8 * -(-n // self.group_size)


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A seed in ``[0, 2**62)`` drawn from a CPU ``generator`` (torch's default one when None), on the host."""
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"stochastic codec: draw seeds from a CPU generator or pass seed=; drawing one from a "
                         f"{generator.device.type} generator would make the host wait for the device at every call")
    # No device argument: the draw is CPU work whatever device the tensor is on.
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())
