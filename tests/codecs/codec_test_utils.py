"""Helpers of the codec tests: building codec pairs (compiled, reference) and comparing packed results."""

from __future__ import annotations

import math
import warnings

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # the "extension not built" warning, asserted elsewhere
    from megatron_adacc.codecs import TINY_SCALE, Packed, _backend, get_codec, reference

EXT = _backend._C
"""The compiled extension, or None when it is not built (then the kernel comparisons are skipped)."""

QUANTIZERS: list[tuple[str, dict]] = [
    ("int4_symmetric", {}),
    ("int4_symmetric", {"group": 7}),
    ("int4_symmetric", {"group": 64}),
    ("int4_asymmetric", {}),
    ("int4_asymmetric", {"group": 5}),
    ("int4_channelwise", {}),
    ("int4_smoothed", {}),
    ("int4_outlier", {}),
    ("int4_outlier", {"z_threshold": 1.0}),
    ("stochastic", {"bits": 1, "group_size": 9}),
    ("stochastic", {"bits": 2, "group_size": 256}),
    ("stochastic", {"bits": 4, "group_size": 33}),
    ("stochastic", {"bits": 8, "group_size": 1000}),
]
"""Every lossy codec with parameters covering odd, even, small and large groups."""


def ids(cases: list[tuple[str, dict]]) -> list[str]:
    return [name + "".join(f"-{k}={v}" for k, v in params.items()) for name, params in cases]


def compress(codec, x: torch.Tensor, seed: int = 7) -> Packed:
    """Compress with a fixed generator for the stochastic codec (so two implementations draw one seed)."""
    if codec.name == "stochastic":
        return codec.compress(x, generator=torch.Generator().manual_seed(seed))
    return codec.compress(x)


def assert_packed_equal(a: Packed, b: Packed) -> None:
    assert a.codec == b.codec and a.shape == b.shape and a.dtype == b.dtype and a.meta == b.meta
    assert a.tensors.keys() == b.tensors.keys()
    for key in a.tensors:
        ta, tb = a.tensors[key], b.tensors[key]
        assert ta.dtype == tb.dtype and ta.shape == tb.shape, key
        # Bitwise comparison (NaN-safe and distinguishes -0.0 from 0.0).
        assert torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)), key


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def pair(name: str, params: dict):
    return get_codec(name, **params), reference.get_codec(name, **params)


def num_outliers(p: Packed) -> int:
    return p.tensors["index"].numel() if "index" in p.tensors else 0


def activation_like(shape: tuple[int, ...], dtype: torch.dtype, outlier_channels: int = 2) -> torch.Tensor:
    """Gaussian values with a few channels (last dim) 30x larger, like LLM activations (Adacc Fig. 3a)."""
    x = torch.randn(shape)
    if x.dim() and shape[-1] > outlier_channels:
        x[..., :outlier_channels] *= 30
    return x.to(dtype)


REL_EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
"""Half an ulp, relative: the error of casting the float32 decode to the output dtype."""


def per_element_scale(name: str, p: Packed, x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """The quantization step S that applies to each element (0 for exactly stored outliers): the stored
    ``scales`` by default, or any tensor laid out like them (one value per group, channel or row)."""
    n = x.numel()
    t = p.tensors
    s = t["scales"] if scales is None else scales
    rows, cols = (math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else (1, 1)
    if name in ("int4_symmetric", "int4_asymmetric", "stochastic"):
        g = p.meta["group"]
        return s.repeat_interleave(g)[:n].view(x.shape)
    if name == "int4_channelwise":
        return s.expand(rows, cols).reshape(x.shape)
    if name == "int4_smoothed":
        return (s[:, None] * t["factors"]).reshape(x.shape)
    s = s[:, None].expand(rows, cols).clone()
    s[:, t["index"].long()] = 0.0
    return s.reshape(x.shape)


def check_bound(name: str, p: Packed, x: torch.Tensor, y: torch.Tensor, step: torch.Tensor | None = None) -> None:
    """``|x - y|`` within the codec's bound for per-element steps ``step`` (default: the stored scales).

    In float64, so that neither the error nor the bound overflows for values near float32's maximum (an
    Inf on both sides would pass vacuously)."""
    xf, yf = x.double(), y.double()
    step = (per_element_scale(name, p, x) if step is None else step).double()
    # Half a step (a full step for stochastic rounding), float32 rounding of the decode, the cast of the
    # decode to the output dtype (with fp16's subnormal spacing), and the flush of tiny groups.
    steps = 1.0 if name == "stochastic" else 0.5
    bound = (
        steps * step * (1 + 1e-5)
        + 1e-6 * (xf.abs() + step)
        + REL_EPS[x.dtype] * yf.abs()
        + (2.0**-24 if x.dtype == torch.float16 else 0.0)
        + 8 * TINY_SCALE
    )
    err = (xf - yf).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
