"""torchrun worker: ResiReduce's transports on N gloo ranks against a reference written out directly, their
error feedback's conservation, and the bytes they move; prints ``RESULT {json}`` lines on rank 0 (run by
tests/comm/test_transport.py).

The batch is two flat buckets with Megatron's shapes of trouble: parameters cut by shard boundaries, a bias
shorter than the number of ranks, an untouched padding tail (so that every bucket splits into 8 equal shards,
as the distributed optimizer's do) and a bucket smaller than the world. Every rank draws every rank's gradients
from seeds, so each computes the whole reference itself.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist

from megatron_adacc.comm.compressors.topk import OWNER_ENTRIES

BUCKETS = [
    [("layers.0.w", (8, 6)), ("layers.0.b", (3,)), ("layers.1.w", (8, 6)), ("emb.weight", (10, 5))],
    [("head.b", (5,))],
]
PADDED = [160, 8]  # elements of each bucket: its parameters, then zeros no parameter covers
DENSITY = 0.1  # q() takes ceil(n / 10) entries
STEPS = 4
#: For counting bytes: a batch the size of a small transformer's bucket (four layers of 256 x 64 weights and
#: their biases, 165 k elements), where payloads, not the per-piece rounding, make up the traffic.
LARGE = [[(f"layers.{i}.{w}", s) for i in range(4) for w, s in (("w", (256, 64)), ("b", (256,)))]
         + [("emb.weight", (512, 64))]]
LARGE_DENSITY = 0.01


def layouts(buckets=None) -> list[tuple[tuple[str, int, tuple[int, ...]], ...]]:
    out = []
    for params in buckets or BUCKETS:
        start, entry = 0, []
        for name, shape in params:
            entry.append((name, start, shape))
            start += math.prod(shape)
        out.append(tuple(entry))
    return out


def gradient(step: int, rank: int, b: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + b)
    out = torch.zeros(PADDED[b])
    used = sum(math.prod(s) for _, s in BUCKETS[b])
    out[:used] = torch.randn(used, generator=gen)
    return out


def ranges(b: int, world: int, transport: str) -> list[tuple[int, int, int]]:
    """``(owner, start, stop)`` of every compressed piece: whole parameters, or their parts in each shard."""
    params = [(start, start + math.prod(shape)) for _, start, shape in layouts()[b]]
    if transport == "allgather":
        return [(-1, lo, hi) for lo, hi in params]
    size = -(-PADDED[b] // world)
    return [(j, max(lo, j * size), min(hi, (j + 1) * size)) for j in range(world) for lo, hi in params
            if max(lo, j * size) < min(hi, (j + 1) * size)]


def q(x: torch.Tensor, compressor: str, multiple: int = 1) -> torch.Tensor:
    """The dense tensor the compressor sends for ``x``: top-k keeps ``multiple`` times ``k`` entries."""
    if compressor == "none":
        return x.clone()
    k = min(x.numel(), multiple * max(1, -(-x.numel() // 10)))  # ceil(DENSITY n), in exact arithmetic
    idx = x.abs().topk(k).indices
    out = torch.zeros_like(x)
    out[idx] = x[idx]
    return out


def reference(world: int, transport: str, compressor: str, shard_only: bool, average: bool) -> list[list]:
    """Every step's reduced buckets, plain error feedback on the ranks and on the owners, computed directly."""
    worker = [[torch.zeros(n) for n in PADDED] for _ in range(world)]
    owner = [torch.zeros(n) for n in PADDED]
    steps = []
    for step in range(STEPS):
        reduced = []
        for b in range(len(BUCKETS)):
            pieces = ranges(b, world, transport)
            sent = []
            for r in range(world):
                c = gradient(step, r, b) + worker[r][b]
                dense = torch.zeros_like(c)
                for _, lo, hi in pieces:
                    dense[lo:hi] = q(c[lo:hi], compressor)
                worker[r][b] = c - dense
                sent.append(dense)
            total = owner[b].clone() if transport == "reduce-scatter" and not shard_only else torch.zeros(PADDED[b])
            for dense in sent:
                total = total + dense
            out = total
            if transport == "reduce-scatter" and not shard_only:
                out = torch.zeros_like(total)
                for _, lo, hi in pieces:  # the owner keeps OWNER_ENTRIES times the entries
                    out[lo:hi] = q(total[lo:hi], compressor, OWNER_ENTRIES)
                owner[b] = total - out
            reduced.append(out / world if average else out)
        steps.append(reduced)
    return steps


def make_reducer(transport: str, compressor: str, buckets=None, density: float = DENSITY):
    from megatron_adacc.comm import build_reducer
    from megatron_adacc.comm.base import ParamSlot

    reducer = build_reducer("residual", compressor, density=density, transport=transport, seed=dist.get_rank())
    reducer.memory.register([ParamSlot(name, shape, torch.float32, b) for b, params in enumerate(buckets or BUCKETS)
                             for name, shape in params])
    return reducer


def reduce_step(reducer, step: int, shard_only: bool, average: bool, async_op: bool):
    from megatron_adacc.comm.base import GradBucket

    buckets = [GradBucket(gradient(step, dist.get_rank(), b), p) for b, p in enumerate(layouts())]
    reducer.reduce(buckets, average=average, async_op=async_op, shard_only=shard_only).wait()
    return buckets


def own_mask(b: int, world: int, shard_only: bool) -> torch.Tensor:
    """The positions of bucket ``b`` this rank must hold the result for (parameters only: padding is free)."""
    mask = torch.zeros(PADDED[b], dtype=torch.bool)
    for owner, lo, hi in ranges(b, world, "reduce-scatter"):
        if not shard_only or owner == dist.get_rank():
            mask[lo:hi] = True
    return mask


def exactness(spec: str) -> dict:
    """``transport:compressor:shard_only:average:async``: every step bit-equal to :func:`reference`."""
    transport, compressor, shard, avg, asy = spec.split(":")
    shard_only, average, world = shard == "1", avg == "1", dist.get_world_size()
    reducer = make_reducer(transport, compressor)
    expected = reference(world, transport, compressor, shard_only, average)
    mismatches = 0
    for step in range(STEPS):
        buckets = reduce_step(reducer, step, shard_only, average, asy == "1")
        for b, bucket in enumerate(buckets):
            mask = own_mask(b, world, shard_only)
            if not torch.equal(bucket.data[mask], expected[step][b][mask]):
                mismatches += 1
    total = torch.tensor([mismatches])
    dist.all_reduce(total)  # on any rank
    kept = reducer.communicators["reduce-scatter"].residuals.values()
    dropped = torch.tensor([max((float(t.abs().max()) for t in kept), default=0.0)])
    dist.all_reduce(dropped, op=dist.ReduceOp.MAX)
    return {"mismatches": int(total), "transport": reducer.transports()["0"], "owner_residual_max": float(dropped)}


def conservation(spec: str) -> dict:
    """``transport:compressor:shard_only``: the reduced sums applied over the steps plus every residual left (the
    ranks' and the owners') equal the sum of every rank's gradients, whatever the compressor drops."""
    transport, compressor, shard = spec.split(":")
    shard_only, world, rank = shard == "1", dist.get_world_size(), dist.get_rank()
    reducer = make_reducer(transport, compressor)
    applied = [torch.zeros(n, dtype=torch.float64) for n in PADDED]
    grads = [torch.zeros(n, dtype=torch.float64) for n in PADDED]
    for step in range(STEPS):
        for b, bucket in enumerate(reduce_step(reducer, step, shard_only, average=False, async_op=False)):
            applied[b] += torch.where(own_mask(b, world, shard_only), bucket.data, 0).double()
            grads[b] += sum(gradient(step, r, b).double() for r in range(world))
    worst, scale = 0.0, 0.0
    for b, params in enumerate(layouts()):
        left = applied[b].clone()
        if shard_only:  # each rank applied its own shard only
            dist.all_reduce(left)
        residuals = torch.zeros(PADDED[b], dtype=torch.float64)
        for name, start, shape in params:
            residuals[start : start + math.prod(shape)] = reducer.memory.residuals[name].reshape(-1).double()
        owned = reducer.communicators["reduce-scatter"].residuals.get(f"0.{b}")
        if owned is not None:
            lo = (-(-PADDED[b] // world)) * rank
            residuals[lo : lo + owned.numel()] += owned.double()
        dist.all_reduce(residuals)
        worst = max(worst, float((left + residuals - grads[b]).abs().max()))
        scale = max(scale, float(grads[b].abs().max()))
    return {"max_error": worst, "scale": scale, "owner_residual_bytes": reducer.residual_bytes()
            - reducer.memory.residual_bytes()}


def traffic(spec: str) -> dict:
    """``transport:compressor:shard_only``: per rank, the bytes one reduction moves, counted three ways."""
    from megatron_adacc.comm.base import GradBucket
    from megatron_adacc.comm.wire import Traffic
    from megatron_adacc.testing.collectives import counting

    transport, compressor, shard = spec.split(":")
    reducer = make_reducer(transport, compressor, LARGE, LARGE_DENSITY)
    gen = torch.Generator().manual_seed(dist.get_rank())
    buckets = []
    for params in layouts(LARGE):
        name, start, shape = params[-1]
        # Padded to a multiple of 8 ranks, as the distributed optimizer's buckets are.
        buckets.append(GradBucket(torch.randn(-(-(start + math.prod(shape)) // 8) * 8, generator=gen), params))
    with counting(Traffic()) as counted:
        reducer.reduce(buckets, shard_only=shard == "1").wait()
    route = reducer.route(buckets, shard_only=shard == "1")
    mine = [counted.total.sent, counted.total.received, reducer.traffic.total.sent,
            reducer.traffic.total.received, route.traffic[dist.get_rank()].sent,
            route.traffic[dist.get_rank()].received]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"per_rank": every, "transport": route.communicator.name}


def main() -> None:
    dist.init_process_group("gloo")
    for arg in sys.argv[1:]:
        kind, spec = arg.split("=", 1)
        result = {"exact": exactness, "conserve": conservation, "bytes": traffic}[kind](spec)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"case": arg, "world": dist.get_world_size(), **result}), flush=True)
    from megatron_adacc.testing import exit_torchrun_worker

    exit_torchrun_worker(0)


if __name__ == "__main__":
    main()
