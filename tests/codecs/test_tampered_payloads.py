"""Decompressing a damaged or tampered payload fails with an error; it never writes outside its output.

The outlier codec's payload carries the channel indices its decompress writes to. A random fuzz over those
indices (negative, one past the end, huge) and over mismatched sizes, for the compiled kernels (every CPU
variant) and the pure-torch reference: each must raise, and the process must survive to say so.
"""

from __future__ import annotations

import random

import pytest
import torch
from codec_test_utils import activation_like, compress, pair

from megatron_adacc.codecs import Packed

BAD_INDICES = (-1, -(2**31), 32, 33, 2**31 - 1)


def _outlier_packed(codec) -> Packed:
    p = compress(codec, activation_like((8, 32), torch.float32, outlier_channels=3))
    assert p.tensors["index"].numel() >= 1
    return p


def _tampered(p: Packed, **tensors: torch.Tensor) -> Packed:
    return Packed(p.codec, p.shape, p.dtype, p.device, {**p.tensors, **tensors}, p.meta)


@pytest.mark.parametrize("implementation", ["kernels", "reference"])
def test_out_of_range_channel_indices_are_refused(implementation, isa):
    kernels, ref = pair("int4_outlier", {"z_threshold": 1.0})
    codec = kernels if implementation == "kernels" else ref
    p = _outlier_packed(codec)
    rng = random.Random(0)
    for bad in BAD_INDICES:
        index = p.tensors["index"].clone()
        index[rng.randrange(index.numel())] = bad
        with pytest.raises(RuntimeError, match="channel index out of range"):
            codec.decompress(_tampered(p, index=index))
    assert torch.equal(codec.decompress(p), codec.decompress(p))  # the untouched payload still decodes


def test_sizes_that_do_not_match_the_shape_are_refused(isa):
    codec, _ = pair("int4_outlier", {"z_threshold": 1.0})
    p = _outlier_packed(codec)
    for name in ("payload", "scales", "outliers"):
        cut = p.tensors[name].reshape(-1)[:-1].clone()
        with pytest.raises((RuntimeError, ValueError)):
            codec.decompress(_tampered(p, **{name: cut}))
