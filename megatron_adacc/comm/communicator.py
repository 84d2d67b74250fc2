"""Moving compressed payloads between data-parallel ranks: the all-gather and all-reduce transports.

* :class:`AllgatherCommunicator` packs every payload of a batch into one byte buffer and all-gathers it (one
  collective per batch; sparse and quantized payloads cannot be summed in flight); every rank then decompresses
  all ``N`` payloads of every parameter. Per rank and batch it sends and receives ``(N - 1) P`` bytes, ``P`` the
  packed payload, so its traffic grows with the number of ranks.
* :class:`AllreduceCommunicator` sums position-aligned payloads with one all-reduce, for compressors whose
  decompression is linear (``Compressor.supports_allreduce``): ``2 (N - 1) / N P`` bytes each way.

The third transport, the compressed reduce-scatter whose traffic does not grow with ``N``, is
:mod:`megatron_adacc.comm.reduce_scatter`; :mod:`megatron_adacc.comm.transport` chooses between them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_adacc.comm import wire
from megatron_adacc.comm.base import Communicator, Compressor, GradBucket, PayloadSpec, PendingExchange, Plan
from megatron_adacc.comm.wire import Moved, Traffic

_ALIGN = 8  # every segment starts 8-byte aligned so that byte slices can be viewed as any dtype

Layout = list[list[tuple[torch.dtype, int, int]]]


def world_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _padded(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def packed_layout(specs: Sequence[Sequence[PayloadSpec]]) -> tuple[int, Layout]:
    """Bytes of the buffer :func:`pack` makes for payloads of these layouts, and each tensor's
    ``(dtype, numel, byte offset)`` in it."""
    layout: Layout = []
    offset = 0
    for payload in specs:
        entry = []
        for spec in payload:
            entry.append((spec.dtype, spec.numel, offset))
            offset += _padded(spec.nbytes)
        layout.append(entry)
    return offset, layout


def pack(payloads: list[list[torch.Tensor]], size: int | None = None) -> tuple[torch.Tensor, Layout]:
    """One uint8 buffer holding every tensor of ``payloads`` (``size`` bytes long when given, the rest zeros)."""
    total, layout = packed_layout([[PayloadSpec(t.dtype, t.numel()) for t in p] for p in payloads])
    device = payloads[0][0].device if payloads and payloads[0] else torch.device("cpu")
    buffer = torch.zeros(total if size is None else size, dtype=torch.uint8, device=device)
    for payload, entry in zip(payloads, layout):
        for t, (_, _, start) in zip(payload, entry):
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[start : start + raw.numel()] = raw
    return buffer, layout


def unpack(buffer: torch.Tensor, layout: Layout) -> list[list[torch.Tensor]]:
    """Inverse of :func:`pack` (views into ``buffer``)."""
    out = []
    for entry in layout:
        tensors = []
        for dtype, numel, start in entry:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            tensors.append(buffer[start : start + nbytes].view(dtype))
        out.append(tensors)
    return out


def piece_views(plan: Plan, buckets: Sequence[GradBucket]) -> list[torch.Tensor]:
    """The flat gradient view of every piece of ``plan``."""
    return [buckets[p.bucket].data[p.start : p.stop] for p in plan.pieces]


def decompress_sum(compressor: Compressor, per_rank: Sequence[Sequence[Sequence[torch.Tensor]]],
                   outputs: Sequence[torch.Tensor]) -> None:
    """``outputs[i] = sum_r decompress(per_rank[r][i])``, ranks in order: every rank that runs this on the same
    payloads gets the same bits, so the replicas stay in lockstep."""
    for i, out in enumerate(outputs):
        out.zero_()
        for payloads in per_rank:
            compressor.decompress_add(payloads[i], out)


class Pending(PendingExchange):
    """Collectives in flight; ``finish`` turns their results into the reduced gradients.

    ``work`` is the last collective, which a torch DDP hook may chain on (it sets ``work`` to None from the
    collective's own completion callback, where waiting on it again would deadlock gloo); ``first`` is an earlier
    one whose result ``finish`` needs before it starts the last (then ``work`` is None: no one can chain)."""

    def __init__(self, work: Any, outputs: list[torch.Tensor], finish: Callable[[], None], first: Any = None):
        self.work, self.first, self.outputs, self.finish, self.done = work, first, outputs, finish, False

    def wait(self) -> None:
        if self.done:
            return
        for work in (self.first, self.work):
            if work is not None:
                work.wait()
        self.first = self.work = None
        with torch.no_grad():
            self.finish()
        self.done = True


class AllgatherCommunicator(Communicator):
    """All-gathers one packed byte buffer per batch (every rank's payload layout is identical)."""

    name = "allgather"

    def traffic(self, plan: Plan) -> list[Moved]:
        size, _ = packed_layout(plan.specs)
        return [wire.all_gather_moved(size, plan.world)] * plan.world

    def start(self, plan: Plan, buckets: Sequence[GradBucket], payloads: list[list[torch.Tensor]],
              compressor: Compressor, group: Any, async_op: bool, traffic: Traffic) -> PendingExchange:
        outputs = piece_views(plan, buckets)
        if plan.world == 1:
            return Pending(None, outputs, lambda: decompress_sum(compressor, [payloads], outputs))
        buffer, layout = pack(payloads)
        length = buffer.numel()
        out = torch.empty(plan.world * length, dtype=torch.uint8, device=buffer.device)
        work = wire.all_gather(out, buffer, group, async_op, traffic)

        def finish() -> None:
            per_rank = [unpack(out[r * length : (r + 1) * length], layout) for r in range(plan.world)]
            decompress_sum(compressor, per_rank, outputs)

        return Pending(work if async_op else None, outputs, finish)


class AllreduceCommunicator(Communicator):
    """Sums every rank's payloads with one all-reduce (position-aligned payloads, linear decompression)."""

    name = "allreduce"

    def traffic(self, plan: Plan) -> list[Moved]:
        size = sum(spec.nbytes for payload in plan.specs for spec in payload)
        return [wire.all_reduce_moved(size, plan.world)] * plan.world

    def start(self, plan: Plan, buckets: Sequence[GradBucket], payloads: list[list[torch.Tensor]],
              compressor: Compressor, group: Any, async_op: bool, traffic: Traffic) -> PendingExchange:
        outputs = piece_views(plan, buckets)
        dtypes = {t.dtype for p in payloads for t in p}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"all-reduce needs payloads of one floating dtype, got {sorted(map(str, dtypes))}")
        flat = torch.cat([t.reshape(-1) for p in payloads for t in p])
        work = wire.all_reduce(flat, group, async_op, traffic)

        def finish() -> None:
            summed, offset = [], 0
            for payload in payloads:
                entry = []
                for t in payload:
                    entry.append(flat[offset : offset + t.numel()])
                    offset += t.numel()
                summed.append(entry)
            decompress_sum(compressor, [summed], outputs)

        return Pending(work if async_op else None, outputs, finish)
