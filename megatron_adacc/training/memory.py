"""Peak memory, measured so that it does not lie (the bytes held for backward are
:class:`megatron_adacc.core.saved.SavedTensorMeter`'s).

* :func:`peak_memory_bytes` is ``torch.cuda.max_memory_allocated`` on CUDA and peak RSS on the CPU. Peak RSS
  under glibc's default malloc keeps freed activation buffers (see docs/measuring.md): benchmarks that compare
  CPU memory run with ``MALLOC_MMAP_THRESHOLD_=65536`` in a process of their own.
"""

from __future__ import annotations

import resource
import sys

import torch


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated since the last reset. CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
