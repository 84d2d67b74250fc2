"""The sync counter itself (megatron_adacc.testing.syncs): what it counts, what it leaves alone, and where."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_adacc.testing.syncs import CudaSyncs, HostSyncs, describe


def _ops(syncs: HostSyncs) -> list[str]:
    return [s.op for s in syncs.events]


def test_reads_of_device_values_and_data_shaped_ops_are_counted():
    x = torch.randn(8)
    with HostSyncs() as syncs:
        x.sum().item()
        bool(x[0] > 0)
        int(torch.count_nonzero(x))
        torch.nonzero(x)
        x[x > 0]
        x.masked_select(x > 0)
        torch.unique(x)
        torch.repeat_interleave(torch.tensor([1, 2], device=x.device))
        x.cpu(), x.tolist(), x.numpy(), x.to("cpu")
    assert _ops(syncs) == [
        "aten._local_scalar_dense.default", "aten._local_scalar_dense.default", "aten._local_scalar_dense.default",
        "aten.nonzero.default", "aten.index.Tensor (boolean mask)", "aten.masked_select.default",
        "aten._unique2.default", "torch.tensor(values, device=...)", "aten.repeat_interleave.Tensor",
        ".cpu()", ".tolist()", ".numpy()", ".to(cpu)",
    ]
    assert all(s.site.startswith("tests/gpu_ready/test_sync_counter.py:") for s in syncs.events)


def test_host_work_and_device_work_alone_are_not_counted():
    x = torch.randn(8)
    gen = torch.Generator().manual_seed(0)
    with HostSyncs() as syncs:
        seed = torch.randint(0, 2**62, (1,), generator=gen).item()  # a CPU generator's draw: host work
        step = torch.tensor(3.0)
        float(step) + seed
        torch.where(x > 0, x, torch.zeros((), device=x.device)).topk(3)  # fixed shapes: no read
        x.masked_fill_(torch.isnan(x), 0.0)
        x.add_(torch.tensor(1.0))  # a 0-dim host tensor goes to the kernel as a scalar
    assert syncs.events == []


def test_a_host_tensor_meeting_the_device_is_one_copy_and_then_on_the_device():
    x = torch.randn(8)
    with HostSyncs() as syncs:
        noise = torch.rand(8, generator=torch.Generator().manual_seed(1)).to(x.device)
        y = x < noise
        y = x < noise  # already brought over
        host = torch.zeros(8)
        host.copy_(x)  # device to host
        host.copy_(x, non_blocking=True)
    assert _ops(syncs) == ["aten.lt.Tensor (host operand)", "aten.copy_"]
    assert [s.kind for s in syncs.events] == ["host-to-device copy", "device-to-host copy"]
    del y


def test_backward_and_its_hooks_are_watched_too():
    p = torch.nn.Parameter(torch.randn(4))
    p.register_post_accumulate_grad_hook(lambda q: [q.grad.sum().item()] and None)
    with HostSyncs() as syncs:
        (p * 2).sum().backward()
    assert _ops(syncs) == ["aten._local_scalar_dense.default"]


def test_a_run_is_compared_with_a_baseline_by_op_and_site():
    x = torch.randn(4)

    def step(extra: bool) -> HostSyncs:
        with HostSyncs() as syncs:
            for _ in range(2):
                x.sum().item()
            if extra:
                x.max().item()
        return syncs

    base, more = step(False), step(True)
    added = more.added_to(base)
    assert len(added) == 1 and "1 x host read" in describe(added)
    assert base.added_to(more) == [] and describe([]) == "  (none)"


def test_wrapped_calls_are_restored_on_exit():
    before = (torch.tensor, torch.Tensor.to, torch.Tensor.cpu)
    with HostSyncs():
        assert torch.tensor is not before[0]
    assert (torch.tensor, torch.Tensor.to, torch.Tensor.cpu) == before
    assert "cpu" not in torch.Tensor.__dict__


def test_cuda_syncs_records_torchs_sync_warnings_at_their_call_site_and_passes_others_on():
    # torch warns with this text at each synchronizing CUDA call under set_sync_debug_mode("warn"); a CPU
    # machine has none to make, so the warning is raised here as torch's C++ raises it for a Python caller.
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with CudaSyncs() as syncs:
            for _ in range(2):
                warnings.warn(CudaSyncs.MESSAGE, UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
            syncs.recording = False
            warnings.warn(CudaSyncs.MESSAGE, UserWarning, stacklevel=1)
    assert [s.kind for s in syncs.events] == ["cuda sync", "cuda sync"]
    assert all(s.site.startswith("tests/gpu_ready/test_sync_counter.py:") for s in syncs.events)
    assert [str(w.message) for w in others] == ["something else"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_syncs_sees_a_real_sync_on_a_gpu():
    x = torch.ones(4, device="cuda")
    with CudaSyncs() as syncs:
        x.sum().item()
    assert len(syncs.events) == 1, describe(syncs.events)
    assert torch.cuda.get_sync_debug_mode() == 0
