"""Moving compressed payloads between data-parallel ranks over ``torch.distributed``.

* :class:`AllgatherCommunicator` packs every payload of a batch into one byte buffer and all-gathers it
  (one collective per batch; sparse and quantized payloads cannot be summed in flight);
* :class:`AllreduceCommunicator` sums position-aligned payloads with one all-reduce, for compressors whose
  decompression is linear (``Compressor.supports_allreduce``).

Bytes sent are counted per rank as a ring algorithm sends them: ``(N - 1) * payload`` for an all-gather,
``2 (N - 1) / N * payload`` for an all-reduce (``N`` ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_adacc.comm.base import Communicator, PendingExchange

_ALIGN = 8  # every segment starts 8-byte aligned so that byte slices can be viewed as any dtype


def world_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _padded(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(payloads: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[list[tuple[torch.dtype, int, int]]]]:
    """One uint8 buffer holding every tensor of ``payloads``; layout ``(dtype, numel, byte offset)``."""
    layout: list[list[tuple[torch.dtype, int, int]]] = []
    offset = 0
    for payload in payloads:
        entry = []
        for t in payload:
            entry.append((t.dtype, t.numel(), offset))
            offset += _padded(t.numel() * t.element_size())
        layout.append(entry)
    device = payloads[0][0].device if payloads and payloads[0] else torch.device("cpu")
    buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
    for payload, entry in zip(payloads, layout):
        for t, (_, _, start) in zip(payload, entry):
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[start : start + raw.numel()] = raw
    return buffer, layout


def unpack(
    buffer: torch.Tensor, layout: list[list[tuple[torch.dtype, int, int]]]
) -> list[list[torch.Tensor]]:
    """Inverse of :func:`pack` (views into ``buffer``)."""
    out = []
    for entry in layout:
        tensors = []
        for dtype, numel, start in entry:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            tensors.append(buffer[start : start + nbytes].view(dtype))
        out.append(tensors)
    return out


class _Done(PendingExchange):
    def __init__(self, result: list[list[list[torch.Tensor]]], bytes_sent: int = 0):
        self.result = result
        self.bytes_sent = bytes_sent

    def wait(self) -> list[list[list[torch.Tensor]]]:
        return self.result


class _PendingGather(PendingExchange):
    def __init__(self, work: Any, out: torch.Tensor, length: int, world: int, layout, bytes_sent: int):
        self.work, self.out, self.length, self.world, self.layout = work, out, length, world, layout
        self.bytes_sent = bytes_sent

    def wait(self) -> list[list[list[torch.Tensor]]]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return [
            unpack(self.out[r * self.length : (r + 1) * self.length], self.layout) for r in range(self.world)
        ]


class AllgatherCommunicator(Communicator):
    """All-gathers one packed byte buffer per batch (every rank's payload layout is identical)."""

    def exchange(self, payloads: list[list[torch.Tensor]], group: Any, async_op: bool) -> PendingExchange:
        world = world_size(group)
        if world == 1:
            return _Done([payloads])
        buffer, layout = pack(payloads)
        out = torch.empty(world * buffer.numel(), dtype=torch.uint8, device=buffer.device)
        work = dist.all_gather_into_tensor(out, buffer, group=group, async_op=async_op)
        return _PendingGather(
            work if async_op else None, out, buffer.numel(), world, layout, (world - 1) * buffer.numel()
        )


class _PendingSum(PendingExchange):
    def __init__(self, work: Any, flat: torch.Tensor, shapes: list[list[int]], bytes_sent: int):
        self.work, self.flat, self.shapes = work, flat, shapes
        self.bytes_sent = bytes_sent

    def wait(self) -> list[list[list[torch.Tensor]]]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        out, offset = [], 0
        for sizes in self.shapes:
            entry = []
            for n in sizes:
                entry.append(self.flat[offset : offset + n])
                offset += n
            out.append(entry)
        return [out]


class AllreduceCommunicator(Communicator):
    """Sums every rank's payloads with one all-reduce; result is a single "rank" holding the sums."""

    def exchange(self, payloads: list[list[torch.Tensor]], group: Any, async_op: bool) -> PendingExchange:
        world = world_size(group)
        if world == 1:
            return _Done([payloads])
        dtypes = {t.dtype for p in payloads for t in p}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(
                f"all-reduce needs payloads of one floating dtype, got {sorted(map(str, dtypes))}"
            )
        flat = torch.cat([t.reshape(-1) for p in payloads for t in p])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        nbytes = flat.numel() * flat.element_size()
        return _PendingSum(
            work if async_op else None,
            flat,
            [[t.numel() for t in p] for p in payloads],
            int(2 * (world - 1) / world * nbytes),
        )


def communicator_for(supports_allreduce: bool) -> Communicator:
    """All-reduce when the compressor allows it, all-gather otherwise."""
    return AllreduceCommunicator() if supports_allreduce else AllgatherCommunicator()
