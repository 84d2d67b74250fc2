"""Where each parameter lives in the distributed optimizer's buffers: Megatron's layout, computed without them.

Megatron's distributed optimizer shards its optimizer states by position in DDP's contiguous gradient buffer
(megatron-core's ``_ParamAndGradBuffer`` with ``use_distributed_optimizer``): parameters of one dtype, in
reverse order (roughly the order backward produces their gradients), each starting at a multiple of 64
elements, cut into buckets of about ``bucket_size`` elements, each bucket padded to a multiple of
``lcm(data-parallel size, 128)``; data-parallel rank ``r`` owns the ``r``-th of the bucket's equal slices.
AdamA with the distributed optimizer shards ``m``, ``v`` and the fp32 master weights the same way, but must not
allocate that buffer (it is the gradient memory AdamA removes), so :func:`plan_buckets` computes the same
positions alone. ``tests/optim/test_adama_layout.py`` checks them against Megatron's own buffers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Bucket", "default_bucket_size", "plan_buckets"]

#: Megatron's alignment of a parameter's start within the buffer (128 bytes of a 16-bit type).
PARAM_ALIGNMENT = 64
#: Megatron's alignment of a bucket's end (256 bytes of a 16-bit type), joined by the data-parallel size.
BUCKET_ALIGNMENT = 128
#: With ``pad_buckets_for_high_nccl_busbw`` Megatron also makes every bucket a multiple of this.
HIGH_BUSBW_ALIGNMENT = 2**16


def default_bucket_size(dp_size: int) -> int:
    """Megatron's bucket size when none is given: ``max(40M, 1M x data-parallel size)`` elements."""
    return max(40_000_000, 1_000_000 * dp_size)


@dataclass(frozen=True)
class Bucket:
    """One bucket of the layout: its parameters and where each lies, in elements from the bucket's start."""

    index: int
    """Position among all buckets, which is the order every rank reduces them in."""
    dtype: torch.dtype
    numel: int
    """Elements, padding included: a multiple of the data-parallel size."""
    params: tuple[torch.nn.Parameter, ...]
    ranges: tuple[tuple[int, int], ...]
    """``(start, end)`` of each of ``params`` within the bucket."""

    def shard(self, rank: int, dp_size: int) -> tuple[int, int]:
        """``(start, end)`` of the slice data-parallel rank ``rank`` owns."""
        size = self.numel // dp_size
        return rank * size, (rank + 1) * size


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def _starts_own_bucket(param: torch.nn.Parameter) -> bool:
    # Megatron gives the embedding shared across pipeline stages a bucket of its own under the distributed
    # optimizer, so both stages shard it alike.
    return bool(getattr(param, "shared_embedding", False))


def _plan_buffer(params: Sequence[torch.nn.Parameter], dtype: torch.dtype, bucket_size: int | None,
                 divisor: int, first_index: int) -> list[Bucket]:
    """One dtype's buffer, cut into buckets by megatron-core's rules (``_ParamAndGradBuffer.__init__``)."""
    buckets: list[Bucket] = []
    members: list[tuple[torch.nn.Parameter, int, int]] = []
    bucket_start = param_start = param_end = 0

    def close(end: int) -> int:
        nonlocal bucket_start, members
        bucket_end = _pad(end, divisor)
        buckets.append(Bucket(first_index + len(buckets), dtype, bucket_end - bucket_start,
                              tuple(p for p, _, _ in members),
                              tuple((s - bucket_start, e - bucket_start) for _, s, e in members)))
        bucket_start, members = bucket_end, []
        return bucket_end

    for param in reversed(params):
        param_start = _pad(param_start, PARAM_ALIGNMENT)
        if _starts_own_bucket(param) and members:
            param_start = close(param_start)
        param_end = param_start + param.numel()
        members.append((param, param_start, param_end))
        full = bucket_size is not None and param_end - bucket_start >= bucket_size
        param_start = close(param_end) if full or _starts_own_bucket(param) else param_end
    if members:
        close(param_end)
    return buckets


def plan_buckets(chunks: Iterable[Iterable[torch.nn.Parameter]], dp_size: int, bucket_size: int | None, *,
                 pad_for_high_nccl_busbw: bool = False) -> list[Bucket]:
    """Megatron's distributed-optimizer layout of each chunk's trainable parameters (one buffer per chunk and
    parameter dtype, in the order the dtypes first appear), its buckets numbered in the order they reduce.

    ``bucket_size`` ``None`` makes one bucket per buffer, as Megatron does without ``--overlap-grad-reduce``."""
    divisor = math.lcm(dp_size, BUCKET_ALIGNMENT, HIGH_BUSBW_ALIGNMENT if pad_for_high_nccl_busbw else 1)
    buckets: list[Bucket] = []
    for chunk in chunks:
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in chunk:
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            buckets += _plan_buffer(params, dtype, bucket_size, divisor, len(buckets))
    return buckets
