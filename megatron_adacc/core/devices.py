"""Which device a run means when it names none."""

from __future__ import annotations

import torch

from megatron_adacc.core.errors import IntegrationError


def resolve_device(requested: str | torch.device | None = "auto") -> torch.device:
    """``auto`` (or None): CUDA when torch sees a GPU, else the CPU. Asking for CUDA without one is refused
    with the fix, instead of failing at the first allocation."""
    if requested is None or str(requested) == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise IntegrationError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu.")
    return device
