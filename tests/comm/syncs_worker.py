"""Subprocess worker: one reduction of each compressor through the compressed reduce-scatter, on rank 1 of a
fake 4-rank group (torch's ``fake`` backend moves nothing; its collectives' outputs read as zeros, a valid empty
payload), counted by :class:`~megatron_adacc.testing.syncs.HostSyncs`; prints ``RESULT {json}`` per case (run by
tests/comm/test_transport_syncs.py)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

PARAMS = (("layers.0.w", 0, (64, 32)), ("layers.0.b", 2048, (64,)), ("layers.1.w", 2112, (64, 32)))
DEVICE = torch.device("cpu")  # a factory given a device object makes what the counter takes for device tensors


def zeroed(original):
    def collective(output, *args, **kwargs):
        work = original(output, *args, **kwargs)
        output.zero_()
        return work
    return collective


def main() -> None:
    from megatron_adacc.comm import build_reducer
    from megatron_adacc.comm.base import GradBucket, ParamSlot
    from megatron_adacc.testing.syncs import HostSyncs, describe

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    dist.all_to_all_single = zeroed(dist.all_to_all_single)
    dist.all_gather_into_tensor = zeroed(dist.all_gather_into_tensor)
    for compressor in ("topk", "dgc", "qsgd"):
        for shard_only in (False, True):
            reducer = build_reducer("w+2d", compressor, density=0.05, transport="reduce-scatter", group_size=2)
            reducer.memory.register([ParamSlot(n, s, torch.float32, 0, DEVICE) for n, _, s in PARAMS])
            steps = []
            for _ in range(2):  # the first plans the batch and allocates the owners' residuals
                bucket = GradBucket(torch.randn(4176, device=DEVICE), PARAMS)
                with HostSyncs() as syncs:
                    reducer.reduce([bucket], shard_only=shard_only, average=True).wait()
                steps.append(syncs.events)
            print("RESULT " + json.dumps({"case": f"{compressor}:{int(shard_only)}",
                                          "transport": reducer.transports()["0"], "syncs": len(steps[-1]),
                                          "described": describe(steps[-1])}), flush=True)


if __name__ == "__main__":
    main()
