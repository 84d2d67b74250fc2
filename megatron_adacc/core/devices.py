"""Which device a run means when it names none, and how much of it a run used at most."""

from __future__ import annotations

import re
import resource
import sys

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


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory_bytes` (CUDA; a process's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


_RESET_PEAKS = [0]
"""The largest peak resident size seen before a reset of the process's own (Linux can reset it; a backward
trace does, per stage), so that :func:`peak_memory_bytes` still answers for the whole process."""


def note_peak_before_reset(nbytes: int) -> None:
    """Called by whoever resets the process's peak resident size, with the peak it is about to reset."""
    _RESET_PEAKS[0] = max(_RESET_PEAKS[0], int(nbytes))


_STATUS_FIELD = {name: re.compile(rb"%s:\s+(\d+) kB" % name.encode()) for name in ("VmHWM", "VmRSS")}


def _status_bytes(name: str) -> int | None:
    try:
        with open("/proc/self/status", "rb") as f:
            match = _STATUS_FIELD[name].search(f.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def resident_bytes() -> int:
    """This process's resident set size now (Linux; 0 where the system does not say)."""
    return _status_bytes("VmRSS") or 0


def peak_resident_bytes() -> int:
    """This process's own peak resident set size since it started or since the last reset of it.

    Linux: ``VmHWM``, the high-water mark of this process's own memory. Not ``getrusage``'s ``ru_maxrss``:
    Linux carries it over ``exec``, so a process started by ``subprocess`` (which execs from a ``vfork``
    sharing the parent's memory) reports its *parent's* peak when that is larger. A test worker or a
    training process that launches ``adacc train`` would lend it its own hundreds of MiB. Elsewhere
    ``ru_maxrss`` is all there is."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated since the last reset. CPU: this process's peak resident set size
    (:func:`peak_resident_bytes`, and the peaks before any reset of it).

    Peak RSS under glibc's default malloc keeps freed activation buffers (docs/measuring.md): runs that compare
    CPU memory set ``MALLOC_MMAP_THRESHOLD_=65536``."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return max(peak_resident_bytes(), _RESET_PEAKS[0])
