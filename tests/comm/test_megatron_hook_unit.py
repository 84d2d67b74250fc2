"""The start_grad_sync replacement on stand-in bucket groups (both release lines), and attach's checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_adacc.comm import build_reducer
from megatron_adacc.comm.base import ParamSlot
from megatron_adacc.comm.megatron_ddp import (
    UnsupportedDDPConfig,
    _BucketGroupState,
    _check_ddp,
    _make_start_grad_sync,
)


def _bucket_group(overlap=False, scaling=0.5, first_batch=False):
    p1, p2 = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))
    grad_data = torch.arange(1.0, 8.0)
    bucket = SimpleNamespace(grad_data=grad_data, gradient_scaling_factor=scaling, params_list=[p1, p2],
                             param_to_index={p1: (0, 4), p2: (4, 7)}, params_with_extra_main_grads=[])
    cfg = SimpleNamespace(check_for_nan_in_grad=False, check_for_large_grads=False,
                          use_distributed_optimizer=False, overlap_grad_reduce=overlap,
                          average_in_collective=False)
    bg = SimpleNamespace(buckets=[bucket], ddp_config=cfg, is_first_batch=first_batch, grad_reduce_handle=None,
                         data_parallel_group=None, previous_grad_reduce_bucket_group=None)
    names = {p1: "layers.0.w", p2: "b"}
    return bg, names


def _install(bg, names, line, scheme="residual", compressor="none"):
    reducer = build_reducer(scheme, compressor)
    reducer.memory.register([ParamSlot(n, tuple(p.shape), torch.float32, 0) for p, n in names.items()])
    fn = _make_start_grad_sync(line, names, _BucketGroupState(reducer, list(names.values()), 0))
    return (lambda **kw: fn(bg, **kw)), reducer


@pytest.mark.parametrize("line", [(0, 16), (0, 19)])
def test_scales_and_reduces_synchronously(line):
    bg, names = _bucket_group(scaling=0.5)
    start, reducer = _install(bg, names, line)
    start()
    # World of one, identity compressor: the reduced gradient is the scaled local gradient.
    assert torch.equal(bg.buckets[0].grad_data, torch.arange(1.0, 8.0) * 0.5)
    assert bg.grad_reduce_handle is None


def test_overlap_sets_a_waitable_handle_and_first_batch_returns_early():
    bg, names = _bucket_group(overlap=True, scaling=1.0, first_batch=True)
    start, _ = _install(bg, names, (0, 16), compressor="topk")
    start()
    handle = bg.grad_reduce_handle
    assert handle is not None and hasattr(handle, "wait")
    start()  # first batch, already dispatched: a no-op, the handle stays
    assert bg.grad_reduce_handle is handle
    handle.wait()
    # Top-k at density 0.01 keeps one entry per parameter: 4.0 of the first, 7.0 of the second.
    assert bg.buckets[0].grad_data.tolist() == [0, 0, 0, 4.0, 0, 0, 7.0]


def test_second_outstanding_reduction_is_refused():
    bg, names = _bucket_group(overlap=True)
    start, _ = _install(bg, names, (0, 16))
    start()
    with pytest.raises(AssertionError, match="outstanding"):
        start()


def test_019_prologue_drains_predecessor_and_copies_extra_main_grads():
    bg, names = _bucket_group(scaling=1.0)
    drained = []
    bg.previous_grad_reduce_bucket_group = SimpleNamespace(
        grad_reduce_handle=object(), finish_grad_sync=lambda force_all_reduce: drained.append(force_all_reduce))
    p = bg.buckets[0].params_list[1]
    p.main_grad = torch.tensor([10.0, 20.0, 30.0])
    p.main_grad_copy_in_grad_buffer = bg.buckets[0].grad_data[4:7]
    bg.buckets[0].params_with_extra_main_grads = [p]
    start, _ = _install(bg, names, (0, 19))
    start(force_all_reduce=True)
    assert drained == [True]
    assert bg.buckets[0].grad_data.tolist() == [1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0]
    # The 0.16 path has none of these steps.
    bg, names = _bucket_group(scaling=1.0)
    bg.previous_grad_reduce_bucket_group = SimpleNamespace(grad_reduce_handle=object(),
                                                           finish_grad_sync=lambda **kw: drained.append(9))
    _install(bg, names, (0, 16))[0]()
    assert drained == [True]


def test_check_ddp_refuses_what_it_cannot_serve():
    with pytest.raises(UnsupportedDDPConfig, match="megatron.core.distributed.DistributedDataParallel"):
        _check_ddp(torch.nn.Linear(2, 2))
    ddp = SimpleNamespace(bucket_groups=[], ddp_config=SimpleNamespace(num_distributed_optimizer_instances=2))
    with pytest.raises(UnsupportedDDPConfig, match="num_distributed_optimizer_instances"):
        _check_ddp(ddp)
