"""Helpers of the codec tests: building codec pairs (compiled, reference) and comparing packed results."""

from __future__ import annotations

import warnings

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # the "extension not built" warning, asserted elsewhere
    from megatron_adacc.codecs import Packed, _backend, get_codec, reference

EXT = _backend._C
"""The compiled extension, or None when it is not built (then the kernel comparisons are skipped)."""

QUANTIZERS: list[tuple[str, dict]] = [
    ("int4_symmetric", {}),
    ("int4_symmetric", {"group": 7}),
    ("int4_symmetric", {"group": 64}),
    ("int4_asymmetric", {}),
    ("int4_asymmetric", {"group": 5}),
    ("int4_channelwise", {}),
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
