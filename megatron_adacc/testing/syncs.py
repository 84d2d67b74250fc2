"""Count what would stop a CUDA stream: the host reads and host-device copies a piece of code makes.

    with HostSyncs() as syncs:
        train_step()
    syncs.events        # [Sync(kind, op, site, stack), ...] in the order they happened

On a GPU, the host waits for the device whenever it needs a tensor's value (``.item()``, ``bool(t)``), a shape that
depends on the values (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing), or a copy between host
and device memory made without ``non_blocking``. Each of these drains the launch queue. This counter finds them on
a CPU, where nothing waits, so that a test can fail when a hot path gains one:

* A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op. Ops whose result the host must
  read, or whose output shape depends on tensor data, are syncs whatever the device.
* Host and device are told apart by where a tensor comes from, since on a CPU both are the CPU. A tensor made by
  a factory called without a ``device``, or with the string ``"cpu"`` (``torch.rand(n, generator=g)``,
  ``torch.tensor(values)``), lives on the host: on a GPU machine that is where such a call puts it. Every other
  tensor (the model's, its inputs', anything made with a device object or from another tensor) stands for a
  device tensor. Ops on host tensors alone are host work and never counted. An op that meets a host tensor of
  one or more dimensions together with device tensors stands for the copy that would bring it over (counted
  once per host tensor; a 0-dim host tensor is passed to a kernel as a scalar and needs none), and so does
  ``torch.tensor(values, device=d)``, which copies Python values to the device.
* The Python calls that copy to the host without any aten op on a CPU (``.cpu()``, ``.tolist()``, ``.numpy()``
  and ``.to("cpu")`` of a device tensor), and the factories, are wrapped while the counter is on. A
  :class:`~torch.overrides.TorchFunctionMode` would not do: it is off inside the torch function it intercepts,
  so it misses everything ``backward()`` runs (autograd hooks, an optimizer folding gradients there).

What it cannot see: a factory given ``torch.device("cpu")`` reads as a device tensor (on a CPU that object and
``x.device`` are the same), and compiled code that reads tensor memory without an aten op.

On a GPU, :class:`CudaSyncs` records what torch itself reports under ``torch.cuda.set_sync_debug_mode("warn")``
instead: every call that synchronizes a CUDA stream, compiled code's included, with the same kind of call sites,
so that the first GPU run (scripts/gpu_acceptance.sh) shows any sync the counter above missed.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

#: aten ops whose result the host reads (a Python number or bool).
_HOST_READS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default})
#: aten ops whose output shape depends on the values of their input: the host must learn it before allocating.
_DATA_SHAPED = frozenset({
    aten.nonzero.default, aten.masked_select.default, aten.bincount.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
})
_MASK_INDEXED = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                           aten._index_put_impl_.default})
_REPEAT_INTERLEAVE = frozenset({aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor})
_COPIES = frozenset({aten.copy_.default, aten._copy_from.default})

#: Factories by name, wrapped in the ``torch`` namespace (where callers look them up at call time).
_FACTORIES = ("tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "rand", "randn", "randint",
              "randperm", "arange", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor", "normal")
#: Factories that copy Python values into the tensor (to the device when one is named).
_FROM_DATA = ("tensor", "as_tensor")
#: ``Tensor`` methods that copy to the host.
_TO_HOST = ("cpu", "tolist", "numpy")

_TORCH_DIR = os.path.dirname(torch.__file__)
_SKIPPED_FILES = (__file__.removesuffix("c"), os.path.dirname(os.__file__) + os.sep)


@dataclass(frozen=True)
class Sync:
    """One point where a GPU's host would wait for the device."""

    kind: str
    """``host read``, ``data-dependent shape``, ``host-to-device copy`` or ``device-to-host copy``."""
    op: str
    """The aten op or Python call (``aten._local_scalar_dense``, ``.tolist()``)."""
    site: str
    """The innermost frame outside torch: ``path:line (function)``, paths relative to their package root."""
    stack: tuple[str, ...]
    """Up to six frames outside torch, innermost first."""

    @property
    def key(self) -> tuple[str, str]:
        """What two runs of the same code have in common: the op and where it was called."""
        return self.op, self.site

    def __str__(self) -> str:
        return f"{self.kind:<20} {self.op:<32} at {' <- '.join(self.stack[:3])}"


def _short(path: str) -> str:
    """``.../site-packages/megatron/core/x.py`` -> ``megatron/core/x.py``; ours relative to the repository."""
    for marker in ("site-packages" + os.sep, "megatron_adacc" + os.sep, "tests" + os.sep):
        if marker in path:
            head, _, tail = path.rpartition(marker)
            return tail if marker.startswith("site") else marker + tail
    return path


def _stack(depth: int = 6) -> tuple[str, ...]:
    frames = []
    frame = sys._getframe(2)
    while frame is not None and len(frames) < depth:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and not path.startswith(_SKIPPED_FILES):
            frames.append(f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return tuple(frames) or ("<torch>",)


class SyncLog:
    """The syncs a counter recorded, and how they compare with another run's."""

    def __init__(self, recording: bool = True) -> None:
        self.recording = recording
        """Whether syncs are recorded now."""
        self.events: list[Sync] = []

    def record(self, kind: str, op: str) -> None:
        if not self.recording:
            return
        stack = _stack()
        self.events.append(Sync(kind, op, stack[0], stack))

    def counts(self) -> Counter:
        """``{(op, site): times}``: what :meth:`added_to` compares."""
        return Counter(event.key for event in self.events)

    def added_to(self, baseline: SyncLog) -> list[Sync]:
        """The syncs of this run beyond those ``baseline`` made at the same op and site (one event per extra)."""
        extra = self.counts() - baseline.counts()
        out = []
        for event in self.events:
            if extra[event.key] > 0:
                extra[event.key] -= 1
                out.append(event)
        return out


class HostSyncs(SyncLog):
    """Context manager recording every :class:`Sync` of the code run inside it (see the module docstring).
    With ``recording`` off, the counter still learns which tensors live on the host."""

    def __init__(self, recording: bool = True) -> None:
        super().__init__(recording)
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._dispatch = _Dispatch(self)
        self._undo: list[tuple[Any, str, Any]] = []

    # -- what the wrappers and the dispatch mode share
    def is_host(self, t: torch.Tensor) -> bool:
        return t in self._host

    def mark_host(self, value: Any) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                self._host[t] = True

    def unmark(self, t: torch.Tensor) -> None:
        self._host.pop(t, None)

    def __enter__(self) -> HostSyncs:
        for name in _FACTORIES:
            self._wrap(torch, name, self._factory)
        for name in (*_TO_HOST, "to"):
            self._wrap(torch.Tensor, name, self._to_host)
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        for owner, name, before in reversed(self._undo):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self._undo.clear()

    # -- the wrapped Python calls
    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        self._undo.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, make(getattr(owner, name), name))

    def _factory(self, original: Any, name: str) -> Any:
        def factory(*args: Any, **kwargs: Any) -> Any:
            from_python = not _has_tensor((args, kwargs))
            on_host = _host_device(kwargs.get("device"))
            if from_python and not on_host and name in _FROM_DATA:
                self.record("host-to-device copy", f"torch.{name}(values, device=...)")
            out = original(*args, **kwargs)
            if from_python and on_host:
                self.mark_host(out)  # on a GPU machine this tensor is on the host
            return out
        return factory

    def _to_host(self, original: Any, name: str) -> Any:
        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.is_host(tensor) and (name != "to" or _names_cpu(args, kwargs)):
                self.record("device-to-host copy", f'.{name}({"cpu" if name == "to" else ""})')
            return original(tensor, *args, **kwargs)
        return method


class CudaSyncs(SyncLog):
    """Context manager recording every call that synchronizes a CUDA stream, as torch reports it under
    ``torch.cuda.set_sync_debug_mode("warn")`` (a warning at each), with its call sites outside torch. Unlike
    :class:`HostSyncs` it sees into compiled code, and it needs a GPU: without one torch reports nothing. Other
    warnings go on to where they went before."""

    MESSAGE = "called a synchronizing CUDA operation"
    """The text of torch's warning (c10/cuda/CUDAFunctions.cpp)."""

    def __enter__(self) -> CudaSyncs:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")  # one warning per sync, not per call site
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if self.MESSAGE in str(message):
                self.record("cuda sync", "set_sync_debug_mode warning")
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        self._mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(*exc)


def describe(events: list[Sync]) -> str:
    """One line per op and site with how many times, for an assertion message."""
    first: dict[tuple[str, str], Sync] = {}
    times: Counter = Counter()
    for event in events:
        first.setdefault(event.key, event)
        times[event.key] += 1
    return "\n".join(f"  {times[key]:>4} x {event}" for key, event in first.items()) or "  (none)"


def _names_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to``'s arguments name the CPU as a string (``x.device`` is left out: see the module)."""
    if kwargs.get("non_blocking", False):
        return False
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.startswith("cpu")


def _host_device(device: Any) -> bool:
    """Whether a factory's ``device`` argument puts its tensor on the host on every machine: none given (the
    default device), or the CPU named as a string (``torch.optim.Adam`` keeps its step counts so)."""
    return device is None or (isinstance(device, str) and device.startswith("cpu"))


def _has_tensor(tree: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in tree_flatten(tree)[0])


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if not owner.is_host(t)]
        if func in _COPIES:
            self._copy(args, kwargs)
        elif on_device:
            self._check(func, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if tensors and not on_device:
            owner.mark_host(out)  # host work stays on the host
        return out

    def _check(self, func, args, kwargs, tensors) -> None:
        owner = self.owner
        name = f"aten.{func.__name__}"
        if func in _HOST_READS:
            owner.record("host read", name)
        elif func in _DATA_SHAPED or (func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None):
            owner.record("data-dependent shape", name)
        elif func in _MASK_INDEXED and any(t is not None and t.dtype in (torch.bool, torch.uint8)
                                           for t in _indices(args)):
            owner.record("data-dependent shape", f"{name} (boolean mask)")
        for t in tensors:
            if owner.is_host(t) and t.dim() > 0:
                owner.record("host-to-device copy", f"{name} (host operand)")
                owner.unmark(t)  # copied over once; later ops find it on the device

    def _copy(self, args, kwargs) -> None:
        owner = self.owner
        dst, src = args[0], args[1]
        if kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
            return
        if owner.is_host(dst) and not owner.is_host(src):
            owner.record("device-to-host copy", "aten.copy_")
        elif owner.is_host(src) and not owner.is_host(dst) and src.dim() > 0:
            owner.record("host-to-device copy", "aten.copy_")


def _indices(args: tuple) -> list:
    indices = args[1] if len(args) > 1 else ()
    return list(indices) if isinstance(indices, (list, tuple)) else []


def train_step_syncs(argv: list[str], counted_step: int = 2,
                     counter: type[SyncLog] = HostSyncs) -> tuple[SyncLog, Any]:
    """Run ``adacc train ARGV`` up to step ``counted_step`` and return the syncs of that step alone, with the run
    (its model, optimizer and extensions, for checks that the features did their work).

    The counter (:class:`HostSyncs`, or :class:`CudaSyncs` for a run on a GPU) watches from the set-up on, so that
    it knows which tensors the steps before made on the host (an optimizer's step counts), but records only the
    counted step: set-up, the first step's allocations and a feature's first-step work (GACT's sensitivity probe)
    are not the steady state. The step runs as ``adacc train`` runs it, extensions' ``on_step_end`` included."""
    from megatron_adacc.core import host as core_host
    from megatron_adacc.core.saved import NONFINITE
    from megatron_adacc.core.step_end import STEP_END
    from megatron_adacc.training import loop
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.host import TrainHost

    args = parse_train_args(list(argv) + ["--train-iters", str(counted_step), "--no-progress"])
    NONFINITE.reset()
    STEP_END.discard()
    syncs = counter(recording=False)
    saved_bytes: list[int] = []
    with syncs:
        with core_host.running(TrainHost()):
            run = loop._set_up(args)
        for iteration in range(1, counted_step + 1):
            syncs.recording = iteration == counted_step
            loss, _, _ = loop._train_step(run, iteration, saved_bytes)
            for ext in run.extensions:
                ext.on_step_end(iteration, loss)
    return syncs, run
