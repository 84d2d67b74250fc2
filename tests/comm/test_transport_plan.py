"""The transports' plans and byte model on one process: shards as Megatron cuts them, pieces that tile every
parameter once, the choice of ``auto`` (the collectives run in test_transport.py)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_adacc.comm import build_reducer
from megatron_adacc.comm.base import GradBucket
from megatron_adacc.comm.compressors import build_compressor
from megatron_adacc.comm.reduce_scatter import CompressedReduceScatter, shard_bounds
from megatron_adacc.comm.transport import build_communicators, candidates, choose, plan_for
from megatron_adacc.training.args import parse_train_args

SHAPES = [("layers.0.w", (64, 32)), ("layers.0.b", (64,)), ("layers.1.w", (64, 32)), ("norm", (3,))]


def _bucket(pad: int = 0) -> GradBucket:
    params, start = [], 0
    for name, shape in SHAPES:
        params.append((name, start, shape))
        start += math.prod(shape)
    return GradBucket(torch.zeros(start + pad), tuple(params))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shards_are_megatrons_when_the_bucket_divides(world):
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    buffer = torch.arange(24 * world)
    ours = [buffer[lo:hi] for lo, hi in shard_bounds(buffer.numel(), world)]
    assert all(torch.equal(a, b) for a, b in zip(ours, shard_buffer(buffer, world)))


def test_uneven_buckets_get_ceil_sized_shards():
    assert shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert shard_bounds(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]  # an owner of nothing


@pytest.mark.parametrize("world", [2, 5, 64])
@pytest.mark.parametrize("shard_only", [False, True])
def test_pieces_cover_every_parameter_once_and_no_padding(world, shard_only):
    bucket = _bucket(pad=-sum(math.prod(s) for _, s in SHAPES) % (world if shard_only else 7))
    pieces = CompressedReduceScatter().split([bucket], world, shard_only)
    covered = torch.zeros(bucket.data.numel(), dtype=torch.int64)
    for p in pieces:
        lo, hi = shard_bounds(bucket.data.numel(), world)[p.owner]
        assert lo <= p.start < p.stop <= hi  # within its owner's shard
        covered[p.start : p.stop] += 1
    params = torch.zeros_like(covered)
    for start, stop in bucket.ranges():
        params[start:stop] = 1
    assert torch.equal(covered, params)
    assert [p.owner for p in pieces] == sorted(p.owner for p in pieces)  # packed owner by owner


def test_the_distributed_optimizer_bucket_must_divide():
    with pytest.raises(ValueError, match="equal shards"):
        CompressedReduceScatter().split([_bucket()], 7, shard_only=True)


def test_byte_model_of_the_allgather_and_the_reduce_scatter():
    comms, topk = build_communicators(), build_compressor("topk", density=0.01)
    bucket = _bucket(pad=5)  # 4168 elements: 8 equal shards
    for world in (2, 8):
        gathered = plan_for(comms["allgather"], topk, [bucket], world, 0, False, "0")
        # One payload: 21 + 1 + 21 + 1 top-k entries of 4-byte values and indices, each tensor 8-byte aligned.
        assert gathered.traffic[0].sent == (world - 1) * (2 * 88 + 2 * 8 + 2 * 88 + 2 * 8)
        scattered = plan_for(comms["reduce-scatter"], topk, [bucket], world, 0, False, "0")
        sharded = plan_for(comms["reduce-scatter"], topk, [bucket], world, 0, True, "0")
        for rank in range(world):  # the owners' return is what makes up the difference
            assert scattered.traffic[rank].sent > sharded.traffic[rank].sent
            assert scattered.traffic[rank].received > sharded.traffic[rank].received


def test_auto_candidates():
    topk, none = build_compressor("topk"), build_compressor("none")
    assert candidates("auto", topk, 1) == ("allgather",)  # one process: nothing to move
    assert candidates("auto", topk, 8) == ("allgather", "reduce-scatter")
    assert candidates("auto", none, 8) == ("allreduce",)  # payloads that add up in flight
    assert candidates("reduce-scatter", none, 8) == ("reduce-scatter",)
    with pytest.raises(ValueError, match="unknown transport"):
        candidates("ring", topk, 8)


def test_auto_takes_the_busiest_ranks_fewer_bytes_and_the_allgather_on_a_tie():
    comms, qsgd, bucket = build_communicators(), build_compressor("qsgd"), _bucket(pad=5)
    assert choose("auto", comms, qsgd, [bucket], 2, 0, False, "0").communicator.name == "allgather"
    assert choose("auto", comms, qsgd, [bucket], 3, 0, False, "0").communicator.name == "reduce-scatter"
    assert choose("auto", comms, qsgd, [bucket], 2, 0, True, "0").communicator.name == "reduce-scatter"


def test_a_checkpoint_of_another_transport_is_refused():
    saved = build_reducer("residual", "topk", transport="reduce-scatter").state_dict()
    with pytest.raises(ValueError, match="--resireduce-transport reduce-scatter"):
        build_reducer("residual", "topk", transport="allgather").load_state_dict(saved)


def test_the_flag_reaches_the_reducer():
    from megatron_adacc.comm.options import ReducerOptions

    args = parse_train_args(["--resireduce", "w", "--resireduce-transport", "reduce-scatter"])
    assert ReducerOptions.from_args(args).transport == "reduce-scatter"
    with pytest.raises(SystemExit):
        parse_train_args(["--resireduce", "w", "--resireduce-transport", "ring"])
