"""Process-group and model-parallel set-up for `adacc train` (single process or torchrun)."""

from __future__ import annotations

import os

import torch

from megatron_adacc.core.devices import resolve_device

__all__ = ["free_port", "initialize", "resolve_device"]


def initialize(device: torch.device, seed: int) -> tuple[int, int]:
    """Start torch.distributed (gloo on CPU, nccl on CUDA) and megatron's model-parallel state.

    Works with or without torchrun: a single process becomes rank 0 of a world of 1. Returns (rank, world).
    """
    from megatron.core import parallel_state

    if device.type == "cpu":
        from megatron_adacc.compat import cpu

        cpu.apply()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("gloo" if device.type == "cpu" else "nccl")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    set_seed(seed)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def set_seed(seed: int) -> None:
    """Seed python-side torch RNG and megatron's tracker exactly as Megatron-LM's initialize does."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Tear down megatron's state and the process group, so a process can initialize again (tests)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
