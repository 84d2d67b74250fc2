"""The compressed reduce-scatter: a transport whose bytes per rank do not grow with the number of ranks.

The shape of DeepSpeed's 1-bit Adam compressed all-reduce and ZeRO++'s qgZ, over Megatron's bucket shards:

1. every bucket is cut into ``N`` shards exactly as Megatron's reduce-scatter cuts it (rank ``j`` owns shard
   ``j``); a *piece* is one parameter's part of one shard, and the compressor compresses each piece (layer-wise
   compression, bounded by the shard);
2. one all-to-all sends every piece's payload to the piece's owner;
3. the owner adds the ``N`` decompressed payloads of its pieces into its *owner residual* ``E`` (which holds what
   its earlier re-compressions dropped) and compresses the sum again with ``Q' = Compressor.for_owner()``,
   keeping what that drops: ``E <- (E + sum_i Q^-1(P_i)) - Q'^-1(Q'(E + sum_i Q^-1(P_i)))``;
4. one all-gather of the owners' payloads gives every rank the whole reduced bucket.

With Megatron's distributed optimizer a rank needs only its own shard: steps 3 and 4 reduce to the owner's sum,
with no second compression and no owner residual.

Error feedback stays exact: the ranks' residuals (the memory, ResiReduce's schemes) absorb the first
compression's error as before, the owner residual the second's, so per step ``applied + sum_i e_i + E`` equals
``sum_i g_i`` plus the residuals carried in. ``E`` lives on the owner, one shard of each bucket (``1 / N`` of a
full residual per rank, in the gradients' dtype), saved with the rank's checkpoint. ResiReduce's sharing and
intra-layer compression act on the ranks' residuals only: a shard cuts across parameters, so owner residuals
have no layer to share with, and at ``1 / N`` of the size there is little to save.

``Q'`` is where this transport differs from the all-gather, which applies the sum itself: the sum of ``N``
top-k payloads holds up to ``N k`` entries, of which the owner keeps ``OWNER_ENTRIES k = 4 k`` (all of them up to
4 ranks); QSGD's sum is quantized again with 127 levels. What ``Q'`` drops reaches the model later, through
``E``.

Bytes per rank and batch, ``S_j`` the packed payloads of shard ``j`` (about ``P / N``, ``P`` one rank's
payload) and ``R_j`` what its owner returns (about ``4 P / N`` for top-k and DGC, ``P / N`` for
QSGD): ``sent = sum_{j != rank} S_j + (N - 1) max_j R_j``, ``received = (N - 1) (S_rank + max_j R_j)``, about
``(N - 1) / N (P + N R)`` each way, against the all-gather's ``(N - 1) P``; ``(N - 1) / N P`` with the
distributed optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_adacc.comm import wire
from megatron_adacc.comm.base import Communicator, Compressor, GradBucket, PendingExchange, Piece, Plan
from megatron_adacc.comm.communicator import (
    Layout,
    Pending,
    decompress_sum,
    pack,
    packed_layout,
    piece_views,
    unpack,
)
from megatron_adacc.comm.wire import Moved, Traffic


def shard_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Rank ``j``'s shard ``[start, stop)`` of a flat bucket of ``numel`` elements: equal shards, Megatron's
    ``shard_buffer``, when ``world`` divides ``numel``; otherwise ``ceil(numel / world)`` each, the last shorter."""
    size = -(-numel // world)
    return [(min(j * size, numel), min((j + 1) * size, numel)) for j in range(world)]


@dataclass(frozen=True)
class _Route:
    """What every reduction of one plan reuses: each owner's pieces, and the packed layout and size of its
    pieces' payloads as the ranks send them to it and (``reduced_``) as it sends their sum back."""

    plan: Plan
    owned: tuple[tuple[int, ...], ...]
    layouts: tuple[Layout, ...]
    sizes: tuple[int, ...]
    reduced_layouts: tuple[Layout, ...]
    reduced_sizes: tuple[int, ...]

    @classmethod
    def of(cls, plan: Plan) -> _Route:
        owned = tuple(tuple(i for i, p in enumerate(plan.pieces) if p.owner == j) for j in range(plan.world))
        packed = [packed_layout([plan.specs[i] for i in pieces]) for pieces in owned]
        reduced = packed if plan.owner_specs is None else [
            packed_layout([plan.owner_specs[i] for i in pieces]) for pieces in owned]
        return cls(plan, owned, tuple(layout for _, layout in packed), tuple(size for size, _ in packed),
                   tuple(layout for _, layout in reduced), tuple(size for size, _ in reduced))


class CompressedReduceScatter(Communicator):
    """All-to-all of each shard's payloads to its owner, reduction and re-compression there (with the owner's
    residual), all-gather of the reduced payloads; see the module docstring."""

    name = "reduce-scatter"
    recompresses = True

    def __init__(self) -> None:
        self.routes: dict[str, _Route] = {}
        self.residuals: dict[str, torch.Tensor] = {}
        self._views: dict[str, tuple[Plan, list[torch.Tensor]]] = {}
        self._loaded: dict[str, torch.Tensor] = {}

    def split(self, buckets: Sequence[GradBucket], world: int, shard_only: bool) -> list[Piece]:
        bounds = []
        for bucket in buckets:
            numel = bucket.data.numel()
            if shard_only and numel % world:
                raise ValueError(f"a bucket of {numel} elements does not split into {world} equal shards, as the "
                                 f"distributed optimizer's buckets do")
            bounds.append(shard_bounds(numel, world))
        pieces = []
        for owner in range(world):
            for b, bucket in enumerate(buckets):
                lo, hi = bounds[b][owner]
                for start, stop in sorted(bucket.ranges()):
                    if max(start, lo) < min(stop, hi):
                        pieces.append(Piece(b, max(start, lo), min(stop, hi), owner))
        return pieces

    def traffic(self, plan: Plan) -> list[Moved]:
        route = self._route(plan)
        back = Moved() if plan.shard_only else wire.all_gather_moved(max(route.reduced_sizes), plan.world)
        return [wire.all_to_all_moved(route.sizes, [route.sizes[rank]] * plan.world, rank) + back
                for rank in range(plan.world)]

    def start(self, plan: Plan, buckets: Sequence[GradBucket], payloads: list[list[torch.Tensor]],
              compressor: Compressor, group: Any, async_op: bool, traffic: Traffic) -> PendingExchange:
        route = self._route(plan)
        send, _ = pack(payloads)
        mine = route.sizes[plan.rank]
        received = torch.empty(plan.world * mine, dtype=torch.uint8, device=send.device)
        work = wire.all_to_all(received, send, [mine] * plan.world, list(route.sizes), group, async_op, traffic)
        per_rank = [unpack(received[r * mine : (r + 1) * mine], route.layouts[plan.rank]) for r in range(plan.world)]
        views = piece_views(plan, buckets)
        if plan.shard_only:
            outputs = [views[i] for i in route.owned[plan.rank]]
            return Pending(work, outputs, lambda: decompress_sum(compressor, per_rank, outputs))
        residuals = self._owner_residuals(plan, buckets)
        return Pending(None, views, first=work, finish=lambda: self._reduce_and_gather(
            route, compressor, per_rank, residuals, views, group, traffic))

    def _reduce_and_gather(self, route: _Route, compressor: Compressor, per_rank, residuals: list[torch.Tensor],
                           views: list[torch.Tensor], group: Any, traffic: Traffic) -> None:
        """Steps 3 and 4: reduce and re-compress the own pieces into ``residuals``, all-gather, decompress."""
        plan, again = route.plan, compressor.for_owner()
        reduced = []
        for k, residual in enumerate(residuals):
            for payloads in per_rank:
                compressor.decompress_add(payloads[k], residual)
            payload = again.compress(residual)
            again.decompress_add(payload, residual, alpha=-1.0)
            reduced.append(payload)
        width = max(route.reduced_sizes)
        send, _ = pack(reduced, size=width)
        gathered = torch.empty(plan.world * width, dtype=torch.uint8, device=send.device)
        wire.all_gather(gathered, send, group, False, traffic)
        for owner, pieces in enumerate(route.owned):
            chunk = gathered[owner * width : owner * width + route.reduced_sizes[owner]]
            for i, payload in zip(pieces, unpack(chunk, route.reduced_layouts[owner])):
                views[i].zero_()
                again.decompress_add(payload, views[i])

    def _route(self, plan: Plan) -> _Route:
        route = self.routes.get(plan.key)
        if route is None or route.plan is not plan:
            route = self.routes[plan.key] = _Route.of(plan)
        return route

    def _owner_residuals(self, plan: Plan, buckets: Sequence[GradBucket]) -> list[torch.Tensor]:
        """The owner residual's view for each own piece. Each bucket's own shard is allocated (or taken from a
        loaded checkpoint) at the first reduction of its plan; a batch whose layout changed starts from zero."""
        cached = self._views.get(plan.key)
        if cached is not None and cached[0] is plan:
            return cached[1]
        starts = {}
        for b, bucket in enumerate(buckets):
            lo, hi = shard_bounds(bucket.data.numel(), plan.world)[plan.rank]
            key = f"{plan.key}.{b}"
            if key not in self.residuals or self.residuals[key].numel() != hi - lo:
                fresh = torch.zeros(hi - lo, dtype=bucket.data.dtype, device=bucket.data.device)
                self.residuals[key] = self._adopt(key, fresh)
            starts[b] = lo
        views = [self.residuals[f"{plan.key}.{p.bucket}"][p.start - starts[p.bucket] : p.stop - starts[p.bucket]]
                 for p in (plan.pieces[i] for i in self._route(plan).owned[plan.rank])]
        self._views[plan.key] = (plan, views)
        return views

    def _adopt(self, key: str, fresh: torch.Tensor) -> torch.Tensor:
        loaded = self._loaded.pop(key, None)
        if loaded is None:
            return fresh
        if loaded.shape != fresh.shape or loaded.dtype != fresh.dtype:
            raise ValueError(f"owner residual {key!r} is {tuple(loaded.shape)} {loaded.dtype} in the checkpoint but "
                             f"{tuple(fresh.shape)} {fresh.dtype} here; resume with the data-parallel layout and "
                             f"--resireduce-transport it was saved with")
        return fresh.copy_(loaded)

    def state_dict(self) -> dict[str, Any]:
        return {"owner_residuals": {k: t.detach().clone() for k, t in {**self._loaded, **self.residuals}.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = dict(state.get("owner_residuals", {}))
        for key, residual in self.residuals.items():
            self.residuals[key] = self._adopt(key, residual)

    def residual_bytes(self) -> int:
        return sum(wire.nbytes(t) for t in self.residuals.values())
