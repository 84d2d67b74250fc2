"""What every saved-tensor hook of megatron-adacc shares: which tensors to leave alone, storing a tensor once,
packing dropout masks, noting the NaN/Inf flags codecs return, and counting the bytes of distinct storages.

:class:`SavedTensorStore` is the pack/unpack pair for ``torch.autograd.graph.saved_tensors_hooks``; Adacc's
runtime (one layer forward under a policy), GACT's compressor and the saved-tensor meter specialise it.
:func:`unique_storage_bytes` is the one way bytes are counted: by distinct storage, so views of one tensor,
or a tensor saved twice, count once. :data:`NONFINITE` collects the codecs' NaN/Inf flags on the device and
tells, once the step is over, the tensors that held NaN/Inf.

The mask packer and the compressor are hooks of the subclass rather than code here: core imports no other
package of megatron-adacc, and the features pack masks with the codecs' compiled 1-bit kernel (Adacc also
routes CPU dropout's float multipliers through it), which a pure-torch copy here would only duplicate.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_adacc.core.log import get_logger
from megatron_adacc.core.step_end import STEP_END

__all__ = ["NONFINITE", "CountedStorage", "NonFiniteActivations", "SavedHandle", "SavedTensorStore", "has_data",
           "storage_ptr", "tensor_key", "unique_storage_bytes"]


def storage_ptr(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (every view of one tensor shares it)."""
    return _storage_id(t.untyped_storage())


def has_data(t: torch.Tensor) -> bool:
    """False for a tensor whose storage holds no memory: a meta tensor, or a fake one (``FakeTensorMode``), which
    sizes a model without allocating it (``adacc plan``)."""
    return t.untyped_storage().device.type != "meta"


def _storage_id(storage: torch.UntypedStorage) -> int:
    # Storages without data all sit at address 0 (and a fake tensor's refuses to say): the storage object, which
    # every view of one tensor shares, is their identity. A real storage keeps its address, which an address a
    # freed storage leaves behind shares on purpose (the stores retire such addresses themselves).
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def tensor_key(t: torch.Tensor) -> tuple:
    """Identity of one view: storage, offset, size, stride and dtype. Two tensors with the same key read the
    same values, so one stored copy serves both."""
    return (storage_ptr(t), t.storage_offset(), tuple(t.size()), t.stride(), t.dtype)


def unique_storage_bytes(tensors: Iterable[Any], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (items that are not tensors are skipped).

    ``seen`` holds the storages already counted; pass one set to several calls to count each storage once
    across all of them (it is updated in place). Empty storages add nothing and are not recorded: they all
    share the null address, and none of them holds a byte.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        nbytes, key = storage.nbytes(), _storage_id(storage)
        if nbytes == 0 or key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


class NonFiniteActivations:
    """Saved tensors that held NaN/Inf, found on the device and told once the step is over.

    A codec compresses whatever it is given: its kernel finds NaN/Inf in the min/max pass it runs anyway and
    returns a one-element device flag, and the tensor it decompresses then carries a NaN, so that the gradients
    computed from it are NaN and the host's NaN handling (``adacc train --on-nonfinite``, Megatron's NaN checks)
    skips or stops the step: nothing is silently corrupted. A NaN activation already makes the step's gradients
    NaN, so deferring the check loses nothing, while reading each flag where it is made would stop a GPU's launch
    queue at every saved tensor.

    :meth:`note` keeps the flag with where it came from, and no host read: the flags are a
    :class:`~megatron_adacc.core.step_end.StepEndSource`, read by the host with its own per-step read. The first
    flagged tensor of a step is told in one line on rank 0, naming the layer and op, with the counts; rate-limited
    (a line per step at most, and one per :attr:`interval_s`): a model that saves an infinite value on purpose
    (a -inf attention mask) would otherwise print at every step. :meth:`clean` is the step's verdict as a device
    bool, for a host that decides whether to apply the step before it reads anything.
    """

    #: Notes of a step kept one by one; beyond, their flags are merged and the extra ones named as a count.
    MAX_NOTES = 1 << 16
    #: Flags are concatenated in chunks of this many, so a step holds few small tensors.
    CHUNK = 256

    def __init__(self, interval_s: float = 30.0):
        self.interval_s = interval_s
        self.reset()

    def reset(self) -> None:
        """A new run: nothing noted or found yet, no step begun, nothing told."""
        self.total = 0
        """Saved tensors found holding NaN/Inf this run (known once their step is settled)."""
        self.last_step = 0
        """How many the last settled step had."""
        self.step: int | None = None
        self._told: tuple[int | None, float] | None = None
        self._chunks: list[torch.Tensor] = []
        self._flags: list[torch.Tensor] = []
        self._where: list[Any] = []
        self._merged: torch.Tensor | None = None
        self._merged_count = 0

    def begin_step(self, step: int) -> None:
        """The host's iteration, which the next line names (a host that never says has lines without one)."""
        self.step = step

    def note(self, flag: torch.Tensor, where: Any) -> None:
        """Keep a codec's flag (a one-element device tensor, non-zero for NaN/Inf) and where its tensor came
        from: a string, or a callable formatting one only if the flag turns out set. Nothing is read."""
        flag = flag.reshape(1)
        if len(self._where) >= self.MAX_NOTES:
            self._merged = flag if self._merged is None else torch.maximum(self._merged, flag)
            self._merged_count += 1
            return
        self._flags.append(flag)
        self._where.append(where)
        if len(self._flags) == self.CHUNK:
            self._chunks.append(torch.cat(self._flags).to(torch.int32))
            self._flags = []

    def _vector(self) -> torch.Tensor | None:
        parts = self._chunks + ([torch.cat(self._flags).to(torch.int32)] if self._flags else [])
        if self._merged is not None:
            parts.append(self._merged.to(torch.int32))
        return torch.cat(parts) if parts else None

    def clean(self) -> torch.Tensor | None:
        """A device bool: no tensor noted since the last :meth:`take` held NaN/Inf (None: none noted)."""
        vector = self._vector()
        return None if vector is None else vector.eq(0).all()

    # -- a StepEndSource
    def take(self) -> tuple[torch.Tensor, Any] | None:
        """The step's flags, in the order noted, and their places (see :class:`~.step_end.StepEndSource`)."""
        vector = self._vector()
        taken = (self._where, self._merged_count)
        self._chunks, self._flags, self._where, self._merged, self._merged_count = [], [], [], None, 0
        return None if vector is None else (vector, taken)

    def settle(self, taken: Any, values: list[int]) -> None:
        """Count the flagged tensors of the step and tell the first one (see the class)."""
        where, merged = taken
        bad = [i for i, v in enumerate(values) if v]  # a set merged flag (past ``where``) counts once
        self.last_step = len(bad)
        if not bad:
            return
        self.total += self.last_step
        now = time.monotonic()
        if self._told is not None and (self._told[0] == self.step or now - self._told[1] < self.interval_s):
            return
        self._told = (self.step, now)
        first = where[bad[0]] if bad[0] < len(where) else f"one of {merged} tensors noted late in the step"
        first = first() if callable(first) else first
        if _rank() == 0:
            at = "" if self.step is None else f"iteration {self.step}: "
            get_logger().warning(
                f"{at}NaN/Inf in a saved activation ({first}): compressed as it was, it decompresses with a NaN, "
                f"so the step's gradients are NaN; {self.last_step} such tensor(s) this step, {self.total} this run "
                f"(told at most once a step and every {self.interval_s:g} s)")


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


#: The process's :class:`NonFiniteActivations`: every :class:`SavedTensorStore` notes its codecs' flags here.
NONFINITE = STEP_END.register(NonFiniteActivations())


class SavedHandle:
    """What a pack hook hands autograd instead of a tensor; :meth:`unpack` gives the tensor back."""

    __slots__ = ("__weakref__",)

    def unpack(self) -> torch.Tensor:  # pragma: no cover - abstract
        """The saved tensor, restored for backward."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class CountedStorage:
    """One storage in a store's ledger (:meth:`SavedTensorStore.count_storage`)."""

    ref: weakref.ref
    """A weak reference to the tensor that brought the storage in: while it lives, so does the storage."""
    nbytes: int
    """Bytes of the storage."""
    owner: Any = None
    """Whatever the subclass files the storage under (Adacc: the op it is attributed to)."""


class SavedTensorStore:
    """The saved-tensor pack/unpack pair, with the rules every feature applies to what autograd saves.

    :meth:`pack` (the hook) leaves model tensors alone and hands everything else to :meth:`save`, which
    stores each tensor once (:meth:`dedup_key`) through :meth:`store_tensor`, which classifies it:

    * a ``bool`` tensor (a dropout mask) goes to :meth:`pack_mask`, the subclass's lossless 1-bit packer;
    * a floating tensor goes to :meth:`compress`, which returns a packed handle or None to keep it, and hands
      its codec's NaN/Inf flag to :meth:`note_nonfinite` (never read here: see :class:`NonFiniteActivations`);
    * anything else (indices) is kept.

    A kept tensor is stored by reference: the hook returns the tensor itself. Subclasses that need context
    (the op a tensor belongs to) pass it to :meth:`save` and receive it back in the two hooks.
    """

    site: str = ""
    """The part of the model the store serves (Adacc's runtime: one layer), for the line telling a NaN/Inf."""
    weak_dedup: bool = True
    """Whether a stored copy serves a later tensor only while the first tensor is alive. Needed when tensors
    die during the store's life (their memory, and so their key, may be reused); a subclass that retires
    keys itself (:meth:`forget`) sets it False."""

    def __init__(self, model_tensors: Iterable[torch.Tensor | None] = ()):
        self.model_storages: set[int] = set()
        """Storages of parameters and buffers, which are never stored or counted."""
        self.set_model_tensors(model_tensors)
        self.dedup_hits = 0
        """Saves answered with an earlier stored copy (since :meth:`clear`)."""
        self.storages: dict[int, CountedStorage] = {}
        """The ledger of :meth:`count_storage`: ``{storage id: CountedStorage}``."""
        self._dedup: dict[Hashable, tuple[weakref.ref | None, Any]] = {}

    # ------------------------------------------------------------------ model tensors
    def set_model_tensors(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Remember the storages of the model's parameters and buffers (None entries are skipped)."""
        self.model_storages = {storage_ptr(t) for t in tensors if t is not None}

    def is_model_tensor(self, t: torch.Tensor) -> bool:
        """True for a parameter, or any view of a model tensor's storage: autograd keeps those anyway."""
        return isinstance(t, torch.nn.Parameter) or storage_ptr(t) in self.model_storages

    # ------------------------------------------------------------------ what subclasses provide
    def dedup_key(self, t: torch.Tensor) -> Hashable | None:
        """The identity under which :meth:`pack` stores ``t`` once, or None for no de-duplication: a tuple
        that starts with the storage id (:meth:`forget` relies on it). The version counter is part of the
        default: a tensor modified in place after a save is a new value."""
        return (*tensor_key(t), t._version)

    def pack_mask(self, t: torch.Tensor, *context: Any) -> Any:
        """Store bool tensor ``t`` losslessly in 1 bit per value: a handle, or None to keep ``t``."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it packs dropout masks")

    def compress(self, t: torch.Tensor, *context: Any) -> Any:
        """Store floating tensor ``t``: a handle, or None to keep ``t`` (the default)."""
        return None

    # ------------------------------------------------------------------ the hooks
    def pack(self, t: torch.Tensor) -> Any:
        """The pack hook: model tensors as they are, anything else through :meth:`save`."""
        if self.is_model_tensor(t):
            return t
        return self.save(t, self.dedup_key(t))

    @staticmethod
    def unpack(obj: Any) -> Any:
        """The unpack hook: the tensor behind a :class:`SavedHandle`, anything else as it is."""
        return obj.unpack() if isinstance(obj, SavedHandle) else obj

    def save(self, t: torch.Tensor, key: Hashable | None, *context: Any) -> Any:
        """What autograd should hold for ``t``: the copy stored under ``key`` if any, else a new one."""
        if key is not None:
            entry = self._dedup.get(key)
            # A dead first tensor means the address was freed and may now hold something else.
            if entry is not None and (entry[0] is None or entry[0]() is not None):
                self.dedup_hits += 1
                return entry[1]
        stored = self.store_tensor(t, *context)
        if key is not None:
            self._dedup[key] = (weakref.ref(t) if self.weak_dedup else None, stored)
        return stored

    def store_tensor(self, t: torch.Tensor, *context: Any) -> Any:
        """Classify ``t`` and store it: the handle :meth:`pack_mask` or :meth:`compress` made, or ``t``."""
        if t.dtype is torch.bool:
            stored = self.pack_mask(t, *context)
        elif t.is_floating_point():
            stored = self.compress(t, *context)
        else:
            stored = None
        return t if stored is None else stored

    def note_nonfinite(self, flag: torch.Tensor | None, t: torch.Tensor, *context: Any) -> None:
        """Hand the NaN/Inf flag a codec returned for ``t`` to :data:`NONFINITE`, with where ``t`` comes from,
        formatted only if the flag turns out set (nothing is read here, and ``t`` is not kept)."""
        if flag is None:
            return
        site, op = self.site_key(), next((c for c in context if isinstance(c, str)), None)
        dtype, shape, describe = t.dtype, tuple(t.shape), type(self).describe_site
        NONFINITE.note(flag, lambda: describe(site, op, dtype, shape))

    def site_key(self) -> Any:
        """What names :attr:`site`, cheap to get at every saved tensor (:meth:`format_site` formats it)."""
        return self.site

    @classmethod
    def format_site(cls, key: Any) -> str:
        """The site named by :meth:`site_key`'s ``key``."""
        return str(key or "")

    @classmethod
    def describe_site(cls, key: Any, op: str | None, dtype: torch.dtype, shape: tuple[int, ...]) -> str:
        """Where a tensor comes from: the store's site, the op if the context names one, the tensor."""
        tensor = f"{str(dtype).removeprefix('torch.')} {'x'.join(map(str, shape)) or 'scalar'}"
        return ", ".join(part for part in (cls.format_site(key), op and f"op {op}", tensor) if part)

    def forget(self, ptr: int) -> None:
        """Retire every stored copy of storage ``ptr`` (it is being freed, and its address may be reused)."""
        for key in [k for k in self._dedup if k[0] == ptr]:
            del self._dedup[key]

    def clear(self) -> None:
        """Drop every stored copy (releasing the store's references to them), the ledger and the counters."""
        self._dedup.clear()
        self.storages.clear()
        self.dedup_hits = 0

    # ------------------------------------------------------------------ accounting
    def count_storage(self, t: torch.Tensor, owner: Any = None) -> int:
        """Add ``t``'s storage to the ledger under ``owner``: its bytes the first time this (live) storage is
        counted, else 0. A storage whose tensor has died is counted afresh, as its address may be reused."""
        ptr = storage_ptr(t)
        entry = self.storages.get(ptr)
        if entry is not None and entry.ref() is not None:
            return 0
        nbytes = t.untyped_storage().nbytes()
        self.storages[ptr] = CountedStorage(weakref.ref(t), nbytes, owner)
        return nbytes

    @property
    def storage_bytes(self) -> int:
        """Bytes of the storages in the ledger (each counted once; alive or since freed)."""
        return sum(entry.nbytes for entry in self.storages.values())


class SavedTensorMeter(SavedTensorStore):
    """Context manager measuring the bytes held for backward by tensors saved inside it.

    It counts the unique storages of every tensor saved through ``save_for_backward`` or by built-in ops,
    parameters excluded. No allocator distorts it, so it is the figure to compare activation policies by on
    any device. It is itself a saved-tensor hook, and only the innermost hooks see a tensor: when a feature
    installs its own hooks (Adacc compress, GACT), that feature reports the bytes it holds instead.

    A :class:`~megatron_adacc.core.saved.SavedTensorStore` that stores every tensor as it is: parameters are
    left out, and everything else is counted in the store's ledger, once per storage.
    """

    def __init__(self, params: list[torch.Tensor] | None = None):
        super().__init__(params or [])
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor``'s storage (unless it is a parameter's) and hand the tensor back unchanged."""
        if not self.is_model_tensor(tensor):
            self.count_storage(tensor)
        return tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages saved since the meter was created or last :meth:`reset`."""
        return self.storage_bytes

    def reset(self) -> None:
        """Forget what was counted so far."""
        self.clear()

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
