"""The measured peak memory of every backward stage: the oracle of the cost model's per-stage bound.

A *stage* is the backward of one op of one layer (:data:`~megatron_adacc.adacc.policy.ops.OP_NAMES`): it starts
when autograd has the gradient of the op's output and ends when it has the gradient of the previous op's output.
While :class:`BackwardTrace` is active, the runtime hooks every op output it produces (a gradient hook, the
stage boundary), and at each boundary the trace reads the process's peak resident size since the previous
boundary and resets it (Linux: ``VmHWM`` in ``/proc/self/status``, reset by writing ``5`` to
``/proc/self/clear_refs``). The forward of each op is a stage too (``F<layer>/<op>``); what runs after the last
layer's forward and before the first backward stage (the output layer, the loss and their backward) is ``head``,
and what runs before the first layer's forward is ``forward``. Softmax masks the scores in place, after which
autograd no longer calls their gradient hook: the backward of ``scores`` is part of the ``softmax`` stage.

Resident size follows live tensors only when freed buffers go back to the system, so a trace needs
``MALLOC_MMAP_THRESHOLD_=65536`` from the process's start (large blocks then come from their own mappings, which
slows their allocation: a measuring tool, off unless asked for). A layer that keeps every activation, which
runs megatron's own forward otherwise, runs the runtime's decomposition of it under a trace (the same ops,
saving the same tensors), so that its stages are seen too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.core.devices import note_peak_before_reset, peak_resident_bytes, resident_bytes
from megatron_adacc.core.errors import AdaccError

_M_MMAP_THRESHOLD = -3
_LOW_FRAGMENTATION_THRESHOLD = 65536

_ACTIVE: BackwardTrace | None = None


def active() -> BackwardTrace | None:
    """The trace the runtime reports stage boundaries to, or None (the default: the runtime does nothing)."""
    return _ACTIVE


def _reset_peak() -> None:
    note_peak_before_reset(peak_resident_bytes())  # the whole run's peak stays known (core.devices)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def supported() -> bool:
    """Whether this process can measure per-stage peaks (Linux with a resettable peak resident size); asking
    resets nothing."""
    if not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK):
        return False
    return os.path.exists("/proc/self/status")


def low_fragmentation_malloc() -> None:
    """Large blocks from their own mappings from now on, and the heap's free pages given back, so that the
    resident size rises with every large block touched from here (one served from a free heap chunk that was
    still resident would not show). For :func:`transient_bytes`, in a process that may have started without
    ``MALLOC_MMAP_THRESHOLD_``: called before the process allocates what it then measures (the profiler's
    layer), since blocks the heap served earlier keep their pages in ways a late call does not undo."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _LOW_FRAGMENTATION_THRESHOLD)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def trace_problem() -> str | None:
    """Why a :class:`BackwardTrace` cannot measure in this process, or None when it can."""
    if not supported():
        return "--adacc-trace-backward needs Linux's resettable peak resident size (/proc/self/clear_refs)"
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        return ("--adacc-trace-backward measures resident memory, which follows tensors only when glibc returns "
                "freed blocks from the start of the process: run it with MALLOC_MMAP_THRESHOLD_=65536 set")
    return None


def transient_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """How far memory rises above its level at the call while ``fn`` runs (CUDA: allocated bytes; CPU: resident
    size, with the low-fragmentation allocator setting). None where it cannot be measured."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    if not supported():
        return None
    low_fragmentation_malloc()
    before = resident_bytes()
    _reset_peak()
    fn()
    return max(0, peak_resident_bytes() - before)


def bounds(fixed_bytes: float, workspace_bytes: float, stored: Sequence[float],
           stage_bytes: Sequence[Sequence[float]], forward_bytes: Sequence[Sequence[float]] = ()) -> dict[str, float]:
    """The cost model's bound on each stage a trace reports, by label: ``head`` holds every layer's ``stored``
    bytes beside the workspace; stage s of layer l holds what the layers before it stored beside its own
    ``stage_bytes[l][s]`` (what the cost model's per-stage bound counts for the layer that runs its backward
    first; later layers have freed theirs), and so does op s's forward with ``forward_bytes[l][s]`` (the layers
    above it have stored nothing yet)."""
    out = {"head": fixed_bytes + sum(stored) + workspace_bytes}
    for layer, per_stage in enumerate(stage_bytes):
        before = fixed_bytes + sum(stored[:layer])
        for name, nbytes in zip(OP_NAMES, per_stage):
            out[f"L{layer}/{name}"] = before + nbytes
    for layer, per_op in enumerate(forward_bytes):
        before = fixed_bytes + sum(stored[:layer])
        for name, nbytes in zip(OP_NAMES, per_op):
            out[f"F{layer}/{name}"] = before + nbytes
    return out


class TraceUnavailable(AdaccError, RuntimeError):
    """This process cannot measure per-stage peaks (:func:`trace_problem` says why)."""


@dataclass
class Stage:
    label: str
    """``forward``, ``F<layer>/<op>``, ``head``, or ``L<layer>/<op>`` (backward)."""
    peak_bytes: int


@dataclass
class BackwardTrace:
    """``with BackwardTrace() as trace: loss = model(...); loss.backward()`` fills :attr:`stages`.

    A stage that autograd enters twice (an op output reached again) keeps its larger peak under the first
    position. Only one trace is active at a time."""

    stages: list[Stage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._current = "forward"
        self._index: dict[str, int] = {}
        self._hooked: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # tensor -> the label hooked on it

    def __enter__(self) -> BackwardTrace:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a BackwardTrace is already active")
        problem = trace_problem()
        if problem is not None:
            raise TraceUnavailable(problem)
        # Nothing is trimmed or re-tuned here: MALLOC_MMAP_THRESHOLD_ is set from the start, so the resident size
        # already follows large tensors, and giving the heap's free pages back would make a traced run hold less
        # than the untraced run it stands for (auto calibrates its process memory from a traced run).
        _reset_peak()
        _ACTIVE = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        self._close()
        _ACTIVE = None


    def peak(self, prefix: str = "") -> int:
        """The largest peak among stages whose label starts with ``prefix``."""
        return max((s.peak_bytes for s in self.stages if s.label.startswith(prefix)), default=0)

    def by_label(self) -> dict[str, int]:
        return {s.label: s.peak_bytes for s in self.stages}

    # --------------------------------------------------------------------------- called by the runtime
    def mark(self, layer: int | None, op: str, outputs: Any) -> None:
        """Hook the tensors of ``outputs`` (an op's output dict, or a tensor): their gradient starts the stage."""
        label = f"L{-1 if layer is None else layer}/{op}"
        values = outputs.values() if isinstance(outputs, dict) else [outputs]
        for value in values:
            if isinstance(value, torch.Tensor) and value.requires_grad and not isinstance(value, torch.nn.Parameter):
                earlier = self._hooked.get(value)
                if earlier is None:
                    self._hooked[value] = label
                    value.register_hook(lambda grad, label=label: self._enter(label))
                else:
                    # An op that passes a tensor on (a layer's input is the previous layer's output): its stage, the
                    # backward of nothing, ends as it starts, and the stage of the op that made the tensor runs
                    # from there. Hooks run in the order they were added, so this one re-enters the earlier label.
                    value.register_hook(lambda grad, label=label, earlier=earlier: self._pass(label, earlier))

    def enter_forward(self, layer: int | None, op: str | None) -> None:
        """The forward of ``op`` of ``layer`` starts (``None``: a layer's forward ended; what runs until the next
        layer's forward or the first backward stage, the head's forward and backward included, is ``head``)."""
        self._enter("head" if op is None else f"F{-1 if layer is None else layer}/{op}")

    # ------------------------------------------------------------------------------------------ inner
    def _pass(self, label: str, then: str) -> None:
        self._enter(label)
        self._enter(then)

    def _enter(self, label: str) -> None:
        if label != self._current:
            self._close()
            self._current = label

    def _close(self) -> None:
        peak = peak_resident_bytes()
        _reset_peak()
        if self._current in self._index:
            stage = self.stages[self._index[self._current]]
            stage.peak_bytes = max(stage.peak_bytes, peak)
        else:
            self._index[self._current] = len(self.stages)
            self.stages.append(Stage(self._current, peak))
