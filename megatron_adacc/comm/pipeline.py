"""Compensate, compress, update the residual, reduce through a transport: one batch of gradients at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_adacc.comm.base import Compressor, GradBucket, Memory, PendingExchange
from megatron_adacc.comm.communicator import group_rank, world_size
from megatron_adacc.comm.compressors import build_compressor
from megatron_adacc.comm.memories import build_memory
from megatron_adacc.comm.options import DEFAULTS
from megatron_adacc.comm.transport import Route, build_communicators, choose
from megatron_adacc.comm.wire import Traffic
from megatron_adacc.core.errors import IntegrationError


class PendingReduction:
    """Result of :meth:`CompressedReducer.reduce`: ``wait()`` writes the reduced gradients in place."""

    def __init__(self, exchange: PendingExchange, divide_by: int):
        self.exchange, self.divide_by = exchange, divide_by
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.exchange.wait()
        if self.divide_by != 1:
            for out in self.exchange.outputs:
                out.div_(self.divide_by)
        self.done = True


class CompressedReducer:
    """Error-feedback compressed reduction of gradient buckets.

    Per batch: ``G~ = G + R`` (memory.compensate, per parameter), ``P = Q(G~)`` piece by piece (the transport's
    pieces: whole parameters, or their parts in each rank's shard), ``R' = G~ - Q^-1(P)`` written into the
    gradient's own storage and handed to memory.update, then memory.flush(); the transport then leaves the reduced
    gradient in the buckets (divided by the world size when ``average``). The residual step needs no scratch
    buffer: the gradient storage is overwritten by the reduced result anyway. The transport of each batch is
    chosen at its first reduction (:mod:`megatron_adacc.comm.transport`) and kept while its buckets do not change.
    """

    def __init__(self, compressor: Compressor, memory: Memory, transport: str = DEFAULTS.transport):
        self.compressor = compressor
        self.memory = memory
        self.transport = transport
        self.communicators = build_communicators()
        self.routes: dict[str, tuple[tuple, Route]] = {}
        self.traffic = Traffic()

    def reduce(
        self,
        buckets: Sequence[GradBucket] | Sequence[tuple[str, torch.Tensor]],
        group: Any = None,
        average: bool = False,
        async_op: bool = False,
        shard_only: bool = False,
        key: str = "0",
    ) -> PendingReduction:
        """Reduce one batch: :class:`GradBucket` s (or named gradients, each its own bucket). ``shard_only``: only
        each rank's shard of each bucket has to hold the result (the distributed optimizer's reduce-scatter);
        ``key`` names the batch, the same in every run (it keys the transport's checkpointed state)."""
        buckets = [b if isinstance(b, GradBucket) else GradBucket.of(*b) for b in buckets]
        route = self.route(buckets, group, shard_only, key)
        plan = route.plan
        named = [nv for bucket in buckets for nv in bucket.named_views()]
        payloads = []
        with torch.no_grad():
            for name, grad in named:
                self.memory.compensate(grad, name)
            for piece in plan.pieces:
                grad = buckets[piece.bucket].data[piece.start : piece.stop]
                payload = self.compressor.compress(grad)
                self.compressor.decompress_add(payload, grad, alpha=-1.0)
                payloads.append(payload)
            for name, grad in named:
                self.memory.update(grad, name)
            self.memory.flush()
        exchange = route.communicator.start(plan, buckets, payloads, self.compressor, group, async_op, self.traffic)
        self.traffic.batches += 1
        pending = PendingReduction(exchange, plan.world if average else 1)
        if not async_op:
            pending.wait()
        return pending

    def route(self, buckets: Sequence[GradBucket], group: Any = None, shard_only: bool = False,
              key: str = "0") -> Route:
        """The transport and plan of this batch: chosen at its first reduction, kept while its layout holds."""
        world, rank = world_size(group), group_rank(group)
        layout = (world, rank, shard_only, tuple((b.data.numel(), b.data.dtype, b.params) for b in buckets))
        cached = self.routes.get(key)
        if cached is None or cached[0] != layout:
            route = choose(self.transport, self.communicators, self.compressor, buckets, world, rank, shard_only, key)
            cached = self.routes[key] = (layout, route)
        return cached[1]

    def transports(self) -> dict[str, str]:
        """The transport of every batch reduced so far, by its key."""
        return {key: route.communicator.name for key, (_, route) in self.routes.items()}

    def residual_bytes(self) -> int:
        """Every error-feedback residual held: the memory's and the transports' (owner residuals)."""
        return self.memory.residual_bytes() + sum(c.residual_bytes() for c in self.communicators.values())

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict(),
                "transport": self.transport,
                "communicators": {name: c.state_dict() for name, c in self.communicators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("transport", "auto")  # checkpoints from before the choice was made only all-gathered
        if saved != self.transport:
            raise IntegrationError(f"ResiReduce state was saved with --resireduce-transport {saved}, not "
                                   f"{self.transport}; resume with --resireduce-transport {saved}")
        self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state["compressor"])
        for name, communicator in self.communicators.items():
            communicator.load_state_dict(state.get("communicators", {}).get(name, {}))


def build_reducer(
    scheme: str,
    compressor: str = DEFAULTS.compressor,
    *,
    density: float = DEFAULTS.density,
    qsgd_levels: int = DEFAULTS.qsgd_levels,
    group_size: int = DEFAULTS.group_size,
    phi: float = DEFAULTS.phi,
    ratio: float = DEFAULTS.ratio,
    transport: str = DEFAULTS.transport,
    seed: int = 0,
) -> CompressedReducer:
    """A reducer for ``--resireduce S --grad-compressor C``; ``seed`` should differ per rank."""
    return CompressedReducer(
        build_compressor(compressor, density=density, qsgd_levels=qsgd_levels, seed=seed),
        build_memory(scheme, group_size=group_size, phi=phi, ratio=ratio),
        transport,
    )
