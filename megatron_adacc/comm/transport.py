"""Which transport reduces a batch: the one ``--resireduce-transport`` names, or under ``auto`` the cheapest.

``auto`` (the default) takes the all-reduce for a compressor whose payloads add up in flight (the identity), and
otherwise whichever of the all-gather (:mod:`.communicator`) and the compressed reduce-scatter
(:mod:`.reduce_scatter`) moves fewer bytes through the busiest rank, by the transports' byte model
(:meth:`~megatron_adacc.comm.base.Communicator.traffic`). A tie goes to the all-gather: one collective and one
compression. With ``P`` one rank's payload, the all-gather moves ``(N - 1) P`` each way; the reduce-scatter
about ``5 (N - 1) / N P`` for top-k and DGC (their owners return four times the entries)
and ``2 (N - 1) / N P`` for QSGD, so ``auto`` all-gathers up to 5 ranks for top-k and DGC and 2 for QSGD, and
reduce-scatters beyond; with the distributed optimizer, which needs only the own shard, the reduce-scatter
moves ``(N - 1) / N P`` and is chosen from 2. One process communicates nothing and keeps the all-gather's
layer-wise compression.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_adacc.comm.base import Communicator, Compressor, GradBucket, Plan
from megatron_adacc.comm.communicator import AllgatherCommunicator, AllreduceCommunicator
from megatron_adacc.comm.options import TRANSPORTS
from megatron_adacc.comm.reduce_scatter import CompressedReduceScatter
from megatron_adacc.comm.wire import Moved


def build_communicators() -> dict[str, Communicator]:
    """One communicator of each transport (the reduce-scatter's holds the owners' residuals)."""
    return {c.name: c for c in (AllgatherCommunicator(), AllreduceCommunicator(), CompressedReduceScatter())}


def candidates(transport: str, compressor: Compressor, world: int) -> tuple[str, ...]:
    """The transports ``transport`` (a ``--resireduce-transport`` value) leaves to the byte model."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if world == 1:
        return ("allgather",)
    if transport != "auto":
        return (transport,)
    return ("allreduce",) if compressor.supports_allreduce else ("allgather", "reduce-scatter")


@dataclass(frozen=True)
class Route:
    """The transport chosen for one batch, its plan, and the bytes the byte model says each rank moves."""

    communicator: Communicator
    plan: Plan
    traffic: tuple[Moved, ...]

    @property
    def busiest(self) -> int:
        """Bytes sent plus received by the rank that moves the most."""
        return max(m.total for m in self.traffic)


def plan_for(communicator: Communicator, compressor: Compressor, buckets: Sequence[GradBucket], world: int,
             rank: int, shard_only: bool, key: str) -> Route:
    """``communicator``'s plan for ``buckets`` and what it moves."""
    pieces = tuple(communicator.split(buckets, world, shard_only))

    def specs(c: Compressor) -> tuple:
        return tuple(tuple(c.layout(p.stop - p.start, buckets[p.bucket].data.dtype)) for p in pieces)

    owner_specs = specs(compressor.for_owner()) if communicator.recompresses and not shard_only else None
    plan = Plan(pieces, specs(compressor), world, rank, shard_only, key, owner_specs)
    return Route(communicator, plan, tuple(communicator.traffic(plan)))


def choose(transport: str, communicators: dict[str, Communicator], compressor: Compressor,
           buckets: Sequence[GradBucket], world: int, rank: int, shard_only: bool, key: str) -> Route:
    """The route of ``transport`` for this batch; under ``auto`` the one whose busiest rank moves the fewest bytes
    (every rank computes the same choice: the byte model depends on the layouts alone)."""
    routes = [plan_for(communicators[name], compressor, buckets, world, rank, shard_only, key)
              for name in candidates(transport, compressor, world)]
    return min(routes, key=lambda r: r.busiest)  # min keeps the first of equals: the all-gather
