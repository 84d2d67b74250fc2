"""Memory meters that do not lie.

* :class:`SavedTensorMeter` counts the bytes autograd holds for backward after a forward pass: the unique
  storages of every tensor saved through ``save_for_backward`` or by built-in ops, parameters excluded. No
  allocator distorts it, so it is the figure to compare activation policies by on any device.
* :func:`peak_memory_bytes` is ``torch.cuda.max_memory_allocated`` on CUDA and peak RSS on the CPU. Peak RSS
  under glibc's default malloc keeps freed activation buffers (see docs/measuring.md): benchmarks that compare
  CPU memory run with ``MALLOC_MMAP_THRESHOLD_=65536`` in a process of their own.

The meter is itself a saved-tensor hook, and only the innermost hooks see a tensor: when a feature installs
its own hooks (Adacc compress, GACT), that feature reports the bytes it holds instead.
"""

from __future__ import annotations

import resource
import sys

import torch


class SavedTensorMeter:
    """Context manager measuring the bytes held for backward by tensors saved inside it."""

    def __init__(self, params: list[torch.Tensor] | None = None):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in (params or [])}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._param_ptrs and not isinstance(tensor, torch.nn.Parameter):
            self._storages[ptr] = storage.nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    def reset(self) -> None:
        self._storages.clear()

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated since the last reset. CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def format_bytes(n: float | int | None, digits: int = 1) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return str(n)
