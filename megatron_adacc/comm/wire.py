"""The collectives ResiReduce calls, each counting the bytes it moves from the tensors it is handed.

Per rank, with ``N`` ranks in the group, what one call moves over the network (the ring algorithms NCCL and gloo
run; a rank's own block never leaves it):

==============================================  ==========================  ==========================
collective                                      sent                        received
==============================================  ==========================  ==========================
all-gather of ``s`` bytes per rank               ``(N - 1) s``               ``(N - 1) s``
all-reduce of ``B`` bytes                        ``2 (N - 1) / N B``         ``2 (N - 1) / N B``
reduce-scatter of ``B`` bytes (``B / N`` out)    ``(N - 1) / N B``           ``(N - 1) / N B``
all-to-all, ``s_j`` bytes to and ``t_j`` from j  ``sum_{j != rank} s_j``     ``sum_{j != rank} t_j``
==============================================  ==========================  ==========================

These rules are the one place such counts come from: the transports count their own calls with them, the
``resireduce`` benchmark counts Megatron's collectives with them (it wraps ``torch.distributed``), and the
transports' byte model (:meth:`megatron_adacc.comm.base.Communicator.traffic`) applies them to the sizes it
predicts from payload layouts, so a test can hold the prediction to the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Moved:
    """Bytes one rank sent and received."""

    sent: int = 0
    received: int = 0

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.sent + other.sent, self.received + other.received)

    @property
    def total(self) -> int:
        return self.sent + self.received


def all_gather_moved(nbytes_in: int, world: int) -> Moved:
    """An all-gather of ``nbytes_in`` bytes from every rank."""
    return Moved((world - 1) * nbytes_in, (world - 1) * nbytes_in)


def all_reduce_moved(nbytes: int, world: int) -> Moved:
    """A ring all-reduce of ``nbytes`` bytes: a reduce-scatter and an all-gather of ``nbytes / N`` blocks."""
    moved = int(2 * (world - 1) / world * nbytes)
    return Moved(moved, moved)


def reduce_scatter_moved(nbytes_in: int, world: int) -> Moved:
    """A ring reduce-scatter of ``nbytes_in`` bytes into ``nbytes_in / N`` per rank."""
    moved = int((world - 1) / world * nbytes_in)
    return Moved(moved, moved)


def all_to_all_moved(send_bytes: Sequence[int], receive_bytes: Sequence[int], rank: int) -> Moved:
    """An all-to-all sending ``send_bytes[j]`` to rank ``j`` and receiving ``receive_bytes[j]`` from it."""
    return Moved(sum(send_bytes) - send_bytes[rank], sum(receive_bytes) - receive_bytes[rank])


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class Traffic:
    """Bytes this rank sent and received through the transports: the current step, every step, in total."""

    step: Moved = field(default_factory=Moved)
    total: Moved = field(default_factory=Moved)
    batches: int = 0
    per_step: list[Moved] = field(default_factory=list)

    def add(self, moved: Moved) -> None:
        self.step = self.step + moved
        self.total = self.total + moved

    def end_step(self) -> None:
        self.per_step.append(self.step)
        self.step = Moved()


def all_gather(out: torch.Tensor, tensor: torch.Tensor, group: Any, async_op: bool, traffic: Traffic) -> Any:
    """``dist.all_gather_into_tensor``, counted."""
    traffic.add(all_gather_moved(nbytes(tensor), dist.get_world_size(group)))
    return dist.all_gather_into_tensor(out, tensor, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group: Any, async_op: bool, traffic: Traffic) -> Any:
    """``dist.all_reduce`` (sum), counted."""
    traffic.add(all_reduce_moved(nbytes(tensor), dist.get_world_size(group)))
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_to_all(out: torch.Tensor, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
               async_op: bool, traffic: Traffic) -> Any:
    """``dist.all_to_all_single`` with explicit splits (elements of ``tensor``'s dtype), counted."""
    size = tensor.element_size()
    traffic.add(all_to_all_moved([s * size for s in in_splits], [s * size for s in out_splits],
                                 dist.get_rank(group)))
    return dist.all_to_all_single(out, tensor, out_splits, in_splits, group=group, async_op=async_op)
