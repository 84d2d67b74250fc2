"""L2: swap compressed saved tensors to pinned host memory and prefetch them back (section 5.4).

During forward, each packed payload is copied to pinned host memory on a dedicated swap-out stream, so
the copy overlaps the next operators; the device copy is released as soon as that stream is done with it
(``record_stream``). During backward, unpacking tensor ``k`` also starts the copy-in of tensor ``k-1`` on
a swap-in stream: backward visits saved tensors roughly in reverse order, so the next one needed is
usually already on the device. CUDA events order the streams.

On a machine without CUDA there is no device memory to relieve; the manager says so once and stays
inactive (L2 then behaves exactly like L1).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor inside a codec payload (tensor, dataclass, named tuple, list, dict)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(getattr(obj, "tensors", None), dict):  # megatron_adacc.codecs.Packed
        new = copy.copy(obj)
        new.tensors = {k: map_tensors(v, fn) for k, v in obj.tensors.items()}
        if hasattr(new, "device"):
            new.device = next(iter(new.tensors.values())).device if new.tensors else new.device
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


class _Entry:
    __slots__ = ("device_payload", "event", "host_payload", "index", "manager", "siblings")

    def __init__(self, manager: SwapManager, siblings: list, host_payload: Any, event: Any):
        self.manager = manager
        self.siblings = siblings  # the entries of the same pass, in pack order
        self.index = len(siblings)
        self.host_payload = host_payload
        self.device_payload: Any = None
        self.event = event

    def fetch(self, packed: Any) -> Any:
        return self.manager.fetch(self)


class SwapManager:
    """Owns the swap-out / swap-in streams of one controller."""

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else None
        self.active = bool(torch.cuda.is_available() and (device is None or device.type == "cuda"))
        self._entries: list[_Entry] = []
        self.swapped_bytes = 0
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        if self.active:
            self._out = torch.cuda.Stream()
            self._in = torch.cuda.Stream()
        else:
            log.warning("GACT L2: no CUDA device, so there is no device memory to swap out; "
                        "swap/prefetch has nothing to do and L2 runs as L1.")

    def offload(self, packed: Any) -> None:
        """Start copying ``packed.payload`` to pinned host memory; the device copy is dropped."""
        compute = torch.cuda.current_stream()
        self._out.wait_stream(compute)

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cuda":
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(self._out)  # the allocator must not reuse t before the copy ran
            return host

        with torch.cuda.stream(self._out):
            host_payload = map_tensors(packed.payload, to_host)
            event = torch.cuda.Event()
            event.record(self._out)
        entry = _Entry(self, self._entries, host_payload, event)
        self._entries.append(entry)
        packed.payload = None
        packed.swap = entry
        self.swapped_bytes += packed.nbytes

    def _start_copy_in(self, entry: _Entry) -> None:
        if entry.device_payload is not None or entry.host_payload is None:
            return
        self._in.wait_event(entry.event)  # the host copy must be complete
        with torch.cuda.stream(self._in):
            entry.device_payload = map_tensors(
                entry.host_payload, lambda t: t.to("cuda", non_blocking=True))
            entry.event = torch.cuda.Event()
            entry.event.record(self._in)

    def fetch(self, entry: _Entry) -> Any:
        """Device payload of ``entry`` (waiting for its prefetch), then prefetch the previous entry."""
        if entry.device_payload is None:
            self.prefetch_misses += 1
            self._start_copy_in(entry)
        else:
            self.prefetch_hits += 1
        compute = torch.cuda.current_stream()
        compute.wait_event(entry.event)
        payload, entry.device_payload = entry.device_payload, None  # autograd now owns the device copy
        map_tensors(payload, lambda t: (t.record_stream(compute), t)[1])
        if entry.index > 0:
            self._start_copy_in(entry.siblings[entry.index - 1])
        return payload

    def end_pass(self) -> None:
        """Forget the pass's ordering; payloads stay reachable from the packed objects autograd holds."""
        self._entries = []
