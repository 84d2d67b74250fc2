"""AdamA's distributed-optimizer layout is Megatron's: the same buckets, and every parameter at the same place,
as megatron-core's own DDP buffers with the distributed optimizer (which AdamA must not allocate)."""

from __future__ import annotations

import pytest

from megatron_adacc.optim.layout import plan_buckets
from megatron_adacc.testing import build_tiny_gpt


@pytest.mark.parametrize("bucket_size", [None, 1000, 20_000, 10**9])
def test_buckets_and_offsets_are_megatrons(bucket_size):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = build_tiny_gpt()
    ours = plan_buckets([list(model.parameters())], 1, bucket_size)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=bucket_size,
                                           overlap_grad_reduce=bucket_size is not None)
    (buffer,) = DistributedDataParallel(config=model.config, ddp_config=config, module=model).buffers
    assert [b.numel for b in ours] == [end - start for start, end in buffer.bucket_indices]
    assert sum(len(b.params) for b in ours) == len(buffer.param_index_map)
    for bucket in ours:
        start = buffer.bucket_indices[bucket.index][0]
        for p, (s, e) in zip(bucket.params, bucket.ranges):
            assert buffer.param_index_map[p] == (start + s, start + e, bucket.index)


def test_shards_split_each_bucket_evenly():
    model = build_tiny_gpt()
    for dp in (2, 4, 3):
        for bucket in plan_buckets([list(model.parameters())], dp, 5000):
            assert bucket.numel % (128 * dp if dp == 3 else 128) == 0
            assert [bucket.shard(r, dp) for r in range(dp)] == [(r * bucket.numel // dp, (r + 1) * bucket.numel // dp)
                                                                 for r in range(dp)]
