"""The CPU compatibility layer and the version guard."""

import pytest
import torch

from megatron_adacc.compat import UnsupportedMegatronVersion, cpu, megatron_line, megatron_version
from megatron_adacc.testing import init_distributed_single


def test_installed_megatron_is_a_supported_line():
    assert megatron_line() in {(0, 16), (0, 19), (0, 20)}


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2", "0.19.0rc1", "0.20.0"])
def test_supported_versions_parse(version):
    assert megatron_line(version) in {(0, 16), (0, 19), (0, 20)}


@pytest.mark.parametrize("version", ["0.13.0", "0.21.0", "1.0.0"])
def test_unknown_version_error_names_it(version, monkeypatch):
    monkeypatch.delenv("ADACC_ALLOW_UNTESTED_MEGATRON", raising=False)
    with pytest.raises(UnsupportedMegatronVersion, match=version.replace(".", r"\.")):
        megatron_line(version)


def test_untested_version_allowed_on_request(monkeypatch):
    monkeypatch.setenv("ADACC_ALLOW_UNTESTED_MEGATRON", "1")
    assert megatron_line("0.21.0") == (0, 21)


def test_apply_is_idempotent():
    init_distributed_single()
    import megatron.core.tensor_parallel.random as mrandom

    fork_before = mrandom.CudaRNGStatesTracker.fork
    cpu.apply()
    cpu.apply()
    assert cpu.is_applied()
    assert mrandom.CudaRNGStatesTracker.fork is fork_before
    assert mrandom.CudaRNGStatesTracker.fork.__wrapped__ is not None


def test_every_function_patch_goes_through_the_patching_helper():
    """Marked and unpatchable like every other patch; the optimizer's by-name import follows the module's."""
    init_distributed_single()
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.optimizer import clip_grads, optimizer

    from megatron_adacc.core.patching import is_patched

    patched = [mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, mrandom.CudaRNGStatesTracker.add,
               mrandom.CudaRNGStatesTracker.fork, clip_grads.clip_grad_by_total_norm_fp32,
               optimizer.Float16OptimizerWithFloat16Params.__init__, cpu._TORCH_PROXY.zeros]
    if not getattr(mrandom, "HAVE_TE", False):
        patched.append(mrandom.CheckpointWithoutOutput.__init__)
    assert all(is_patched(fn) and fn.__wrapped__ is not None for fn in patched)
    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32


def test_refuses_to_activate_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cpu.CudaPresentError, match="CUDA device is present"):
        cpu.apply()


def test_megatron_version_reported():
    import megatron.core

    assert megatron_version() == megatron.core.__version__


def test_rng_tracker_fork_replays_dropout():
    """Inside fork() the tracker's own stream is used, and the default stream is left where it was."""
    init_distributed_single()
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = {k: v.clone() for k, v in tracker.get_states().items()}
    outer = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), outer)
    tracker.set_states(states)
    with tracker.fork():
        b = torch.rand(8)
    assert torch.equal(a, b)
    with tracker.fork():
        c = torch.rand(8)
    assert not torch.equal(b, c)
