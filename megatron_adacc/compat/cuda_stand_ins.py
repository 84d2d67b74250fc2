"""What stands in for CUDA when Megatron runs on a CPU: streams, events and devices that mean "the CPU".

Shared by the two CPU layers: :mod:`megatron_adacc.compat.cpu` (megatron-core's model, DDP and optimizer under
``adacc train``) and :mod:`megatron_adacc.testing.megatron_lm_cpu` (Megatron-LM's whole training loop). Imports
torch only, so the Megatron-LM harness can load it before any Megatron module exists.
"""

from __future__ import annotations

import torch

from megatron_adacc.core.errors import AdaccError

CPU = torch.device("cpu")


class CudaPresentError(AdaccError, RuntimeError):
    """A CPU layer was asked to activate on a machine that has a CUDA device."""


def to_cpu_device(device):
    """``device`` with every CUDA spelling (``'cuda'``, ``'cuda:1'``, an ordinal, ``torch.device('cuda')``)
    mapped to the CPU; anything else unchanged."""
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


class NullStream:
    """Stands in for a CUDA stream: all work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return NullEvent()

    def synchronize(self) -> None:
        pass


class NullEvent(NullStream):
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0
