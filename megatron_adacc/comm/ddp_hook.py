"""ResiReduce as a ``torch.nn.parallel.DistributedDataParallel`` communication hook (no Megatron needed).

Usage::

    state = ResiReduceHookState(model, build_compressor("topk", density=0.01, seed=rank),
                                lambda: build_memory("w+2d", group_size=4))
    ddp.register_comm_hook(state, resireduce_hook)

DDP hands the hook one flat bucket at a time. The bucket is averaged (divided by the world size, as DDP's
default hook does), each parameter's slice is compensated, compressed and turned into its residual, and the
bucket is one batch of the transport (``transport``, :mod:`megatron_adacc.comm.transport`): the all-gather runs
asynchronously and the returned future completes with the decompressed sum; the compressed reduce-scatter
finishes inside the hook, because its all-gather can only start once its all-to-all is done, and a gloo
collective's completion callback cannot wait for another collective.

Reusable groups are formed inside each DDP bucket (a group must be reduced in one call, see
:mod:`megatron_adacc.comm.groups`). DDP rebuilds its buckets once, after the first iteration, in gradient
order; a bucket whose parameters change gets a fresh memory, so the residuals of that first iteration are
dropped once. Pass ``bucket_cap_mb`` large enough to hold whole groups for the full memory saving.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] at run time.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_adacc.comm.base import Compressor, GradBucket, Memory, ParamSlot
from megatron_adacc.comm.options import DEFAULTS
from megatron_adacc.comm.pipeline import CompressedReducer
from megatron_adacc.comm.wire import Traffic


class ResiReduceHookState:
    """State of :func:`resireduce_hook`: parameter names, the compressor and one memory per DDP bucket."""

    def __init__(
        self,
        model: torch.nn.Module,
        compressor: Compressor,
        memory_factory: Callable[[], Memory],
        process_group: Any = None,
        transport: str = DEFAULTS.transport,
    ):
        module = getattr(model, "module", model)
        self.names = {p: n for n, p in module.named_parameters() if p.requires_grad}
        self.all_slots = [ParamSlot(n, tuple(p.shape), p.dtype, 0, p.device) for p, n in self.names.items()]
        self.compressor = compressor
        self.memory_factory = memory_factory
        self.process_group = process_group
        self.transport = transport
        self.reducers: dict[int, tuple[tuple[str, ...], CompressedReducer]] = {}
        self.traffic = Traffic()
        self._pending_state: dict[int, Any] = {}

    def reducer_for(self, index: int, params: list[torch.Tensor]) -> CompressedReducer:
        names = tuple(self.names[p] for p in params)
        entry = self.reducers.get(index)
        if entry is None or entry[0] != names:
            memory = self.memory_factory()
            memory.register(
                [ParamSlot(self.names[p], tuple(p.shape), p.dtype, 0, p.device) for p in params],
                self.all_slots,
            )
            reducer = CompressedReducer(self.compressor, memory, self.transport)
            reducer.traffic = self.traffic
            saved = self._pending_state.pop(index, None)
            if saved is not None and saved["names"] == names:
                memory.load_state_dict(saved["memory"])
                for name, communicator in reducer.communicators.items():
                    communicator.load_state_dict(saved.get("communicators", {}).get(name, {}))
            self.reducers[index] = (names, reducer)
        return self.reducers[index][1]

    def residual_bytes(self) -> int:
        return sum(r.residual_bytes() for _, r in self.reducers.values())

    def state_dict(self) -> dict:
        # The compressor is shared by the buckets' reducers: its state is saved once, and restored at load time
        # rather than with each bucket's first reduction, which would rewind its random stream mid-step.
        return {
            "buckets": {
                i: {"names": names, "memory": r.memory.state_dict(),
                    "communicators": {n: c.state_dict() for n, c in r.communicators.items()}}
                for i, (names, r) in self.reducers.items()
            },
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Residuals are restored when each bucket is first seen (DDP's buckets exist only after backward)."""
        self.compressor.load_state_dict(state["compressor"])
        self._pending_state = dict(state["buckets"])
        self.reducers = {}


def resireduce_hook(state: ResiReduceHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: error-feedback compressed all-gather of one bucket (see module docstring)."""
    buffer = bucket.buffer()
    params = bucket.parameters()
    group = state.process_group
    world = dist.get_world_size(group)
    buffer.div_(world)
    layout, offset = [], 0
    for p in params:
        layout.append((state.names[p], offset, tuple(p.shape)))
        offset += p.numel()
    if offset != buffer.numel():
        raise RuntimeError(
            f"DDP bucket {bucket.index()} holds {buffer.numel()} elements but its parameters "
            f"{offset}; this torch version lays buckets out differently than expected"
        )
    reducer = state.reducer_for(bucket.index(), params)
    pending = reducer.reduce([GradBucket(buffer, tuple(layout))], group=group, average=False, async_op=True,
                             key=str(bucket.index()))
    work = pending.exchange.work

    def finish(_: Any = None) -> torch.Tensor:
        # Running inside the work's own future callback: the collective is complete, and waiting on the work
        # again from here deadlocks gloo.
        pending.exchange.work = None
        pending.wait()
        return buffer

    if work is None:  # nothing in flight, or a transport with a second collective to start: finish here
        fut = torch.futures.Future()
        fut.set_result(finish())
        return fut
    return work.get_future().then(lambda f: finish(f))
