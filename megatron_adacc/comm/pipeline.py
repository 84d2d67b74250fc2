"""Compensate, compress, update the residual, communicate, decompress: one batch of gradients at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_adacc.comm.base import Communicator, Compressor, Memory, PendingExchange
from megatron_adacc.comm.communicator import communicator_for, world_size
from megatron_adacc.comm.compressors import build_compressor
from megatron_adacc.comm.memories import build_memory
from megatron_adacc.comm.options import DEFAULTS


@dataclass
class Traffic:
    """Bytes this rank sent, for the current step and in total."""

    step_bytes: int = 0
    total_bytes: int = 0
    batches: int = 0
    last_step_bytes: int = 0
    per_step: list[int] = field(default_factory=list)

    def add(self, nbytes: int) -> None:
        self.step_bytes += nbytes
        self.total_bytes += nbytes
        self.batches += 1

    def end_step(self) -> None:
        self.last_step_bytes = self.step_bytes
        self.per_step.append(self.step_bytes)
        self.step_bytes = 0


class PendingReduction:
    """Result of :meth:`CompressedReducer.reduce`: ``wait()`` writes the reduced gradients in place."""

    def __init__(
        self, exchange: PendingExchange, grads: Sequence[torch.Tensor], compressor: Compressor, divide_by: int
    ):
        self.exchange, self.grads, self.compressor, self.divide_by = exchange, grads, compressor, divide_by
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        per_rank = self.exchange.wait()
        # Every rank decodes the same payloads in the same (rank) order, so the sums are bit-identical
        # across ranks and the replicas stay in lockstep.
        for i, grad in enumerate(self.grads):
            grad.zero_()
            for payloads in per_rank:
                self.compressor.decompress_add(payloads[i], grad)
            if self.divide_by != 1:
                grad.div_(self.divide_by)
        self.done = True


class CompressedReducer:
    """Error-feedback compressed reduction of named gradient tensors (views into a communication buffer).

    Per batch: ``G~ = G + R`` (memory.compensate), ``P = Q(G~)`` (compressor), ``R' = G~ - Q^-1(P)`` written
    into the gradient's own storage and handed to memory.update, then memory.flush(); the payloads of all
    ranks are exchanged and every gradient becomes ``sum_ranks Q^-1(P_rank)`` (divided by the world size
    when ``average``). The residual step needs no scratch buffer: the gradient storage is overwritten by the
    reduced result anyway.
    """

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator | None = None):
        self.compressor = compressor
        self.memory = memory
        self.communicator = communicator or communicator_for(compressor.supports_allreduce)
        self.traffic = Traffic()

    def reduce(
        self,
        named_grads: Sequence[tuple[str, torch.Tensor]],
        group: Any = None,
        average: bool = False,
        async_op: bool = False,
    ) -> PendingReduction:
        payloads = []
        with torch.no_grad():
            for name, grad in named_grads:
                self.memory.compensate(grad, name)
                payload = self.compressor.compress(grad)
                self.compressor.decompress_add(payload, grad, alpha=-1.0)
                self.memory.update(grad, name)
                payloads.append(payload)
            self.memory.flush()
        exchange = self.communicator.exchange(payloads, group, async_op)
        self.traffic.add(exchange.bytes_sent)
        pending = PendingReduction(
            exchange, [g for _, g in named_grads], self.compressor, world_size(group) if average else 1
        )
        if not async_op:
            with torch.no_grad():
                pending.wait()
        return pending

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state["compressor"])


def build_reducer(
    scheme: str,
    compressor: str = DEFAULTS.compressor,
    *,
    density: float = DEFAULTS.density,
    qsgd_levels: int = DEFAULTS.qsgd_levels,
    group_size: int = DEFAULTS.group_size,
    phi: float = DEFAULTS.phi,
    ratio: float = DEFAULTS.ratio,
    seed: int = 0,
) -> CompressedReducer:
    """A reducer for ``--resireduce S --grad-compressor C``; ``seed`` should differ per rank."""
    return CompressedReducer(
        build_compressor(compressor, density=density, qsgd_levels=qsgd_levels, seed=seed),
        build_memory(scheme, group_size=group_size, phi=phi, ratio=ratio),
    )
