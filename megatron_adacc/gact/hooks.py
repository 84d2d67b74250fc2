"""Saved-tensor hooks that compress every context tensor autograd keeps for backward.

One :class:`SavedTensorCompressor` is shared by all passes of a controller. Each ``with`` block
(:meth:`SavedTensorCompressor.pass_context`) is one *pass*: one micro-batch's forward and backward. Within a
pass, saved float tensors are numbered in the order autograd first sees them; that number is the tensor's
identity ``l`` across iterations (the graph of a training step is static), so its sensitivity, bit width
and compressor seed can be tracked.

What is packed how:

* parameters and module buffers (matched by storage, or any ``Parameter``), and integer tensors: kept as they are;
* ``bool`` tensors (dropout masks): 1 bit per value with the ``bitmask`` codec (lossless);
* floating tensors of at least ``min_numel`` values: the ``stochastic`` per-group quantizer at the bit width
  the controller chose for that tensor (32 bits = kept); NaN/Inf ones are compressed too, their flags told once
  the step is over (:data:`~megatron_adacc.core.saved.NONFINITE`), and they decompress with a NaN;
* a tensor saved by several ops (same storage, offset, shape, stride, dtype and version counter) is packed
  once and the packed object shared, as GACT's footprint de-duplication does. Liveness is checked with a
  weak reference, so a freed tensor whose memory is reused is never mistaken for the old one.

These rules are :class:`~megatron_adacc.core.saved.SavedTensorStore`'s; this module supplies the codecs, the
per-tensor bit widths and seeds, and the per-pass figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megatron_adacc.codecs import get_codec
from megatron_adacc.core.saved import SavedHandle, SavedTensorStore
from megatron_adacc.gact.allocation import KEEP_BITS

CodecFactory = Callable[..., Any]


def default_codec_factory() -> CodecFactory:
    """The codec factory used when the controller is given none: ``megatron_adacc.codecs.get_codec``."""
    return get_codec


def mix_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (splitmix64 rounds), so seeds never depend on hash()."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x = z ^ (z >> 31)
    return x & 0x7FFFFFFFFFFFFFFF


@dataclasses.dataclass
class TensorInfo:
    """What the controller knows about saved tensor ``l`` (from the most recent pass that saw it)."""

    index: int
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class PassStats:
    """Bytes accounting of one pass (forward + backward of one micro-batch)."""

    raw_bytes: int = 0
    """Bytes the saved activations would hold uncompressed (unique storages, parameters excluded)."""
    held_bytes: int = 0
    """Bytes actually held for backward: packed sizes of compressed tensors + storages of kept ones."""
    recompute_bytes: int = 0
    """Bytes packed during backward (activations re-saved by recompute): transient, one layer at a time,
    so not part of ``held_bytes``."""
    swapped_bytes: int = 0
    """Packed bytes moved to host memory (L2); not part of ``held_bytes``' device share."""
    compressed_tensors: int = 0
    kept_tensors: int = 0
    mask_tensors: int = 0
    dedup_hits: int = 0
    """Saves answered with a tensor already stored in this pass (filled when the pass ends)."""


class CompressedSavedTensor(SavedHandle):
    """A compressed saved tensor; autograd holds this instead of the tensor."""

    __slots__ = (
        "bits",
        "codec",
        "device",
        "dtype",
        "nbytes",
        "payload",
        "shape",
        "swap",
        "tensor_id",
    )

    def __init__(self, codec: Any, payload: Any, like: torch.Tensor, tensor_id: int, bits: int):
        self.codec = codec
        self.payload = payload
        self.shape = like.shape
        self.dtype = like.dtype
        self.device = like.device
        self.tensor_id = tensor_id
        self.bits = bits
        self.nbytes = int(payload.nbytes)
        self.swap: Any = None

    def unpack(self) -> torch.Tensor:
        payload = self.swap.fetch(self) if self.swap is not None else self.payload
        out = self.codec.decompress(payload)
        if out.shape != self.shape:
            out = out.reshape(self.shape)
        if out.dtype != self.dtype:
            out = out.to(self.dtype)
        if out.device != self.device:
            out = out.to(self.device, non_blocking=True)
        return out


_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. Megatron's recompute re-saving activations)."""
    return torch._C._current_graph_task_id() != -1


class SavedTensorCompressor(SavedTensorStore):
    """Pack/unpack hooks with per-tensor bit widths and seeds supplied by the controller.

    ``bits_for(tensor_id, numel)`` and ``seed_for(tensor_id)`` are callables owned by the controller, so the
    sensitivity probes can change one tensor's seed without touching this class.
    """

    site = "GACT"

    def __init__(
        self,
        model_tensors: Callable[[], Iterable[torch.Tensor]],
        group_size: int,
        bits_for: Callable[[int, int], int],
        seed_for: Callable[[int], int],
        codec_factory: CodecFactory | None = None,
        min_numel: int | None = None,
        swap: Any = None,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        super().__init__()
        self.group_size = group_size
        self.min_numel = group_size if min_numel is None else min_numel
        self.bits_for = bits_for
        self.seed_for = seed_for
        self._factory = codec_factory
        self._codecs: dict[Any, Any] = {}
        self.swap = swap
        self._model_tensors = model_tensors
        self.refresh_model_tensors()
        self.tensors: dict[int, TensorInfo] = {}
        self.stats = PassStats()
        self.last_stats = PassStats()
        self.peak_held_bytes = 0
        self.peak_raw_bytes = 0
        self.passes = 0
        self._depth = 0
        self.recording = True  # False while the controller probes: probe passes stay out of the figures
        self._next_id = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seed_style: dict[int, str] = {}

    # ------------------------------------------------------------------ setup
    def refresh_model_tensors(self) -> None:
        """Remember the storages of parameters and buffers, which are never compressed or counted. Done at
        every pass, so moving the model (``.cuda()``, a DDP buffer) after building the controller is fine."""
        self.set_model_tensors(self._model_tensors())

    def codec(self, kind: str, **kwargs: Any) -> Any:
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in self._codecs:
            factory = self._factory or default_codec_factory()
            self._codecs[key] = factory(kind, **kwargs)
        return self._codecs[key]

    def _compress_seeded(self, codec: Any, x: torch.Tensor, seed: int) -> Any:
        """Call ``codec.compress`` with the tensor's seed, whichever way the codec takes it (an integer
        ``seed`` for counter-based codecs, else a seeded ``torch.Generator``)."""
        how = self._seed_style.get(id(codec))
        if how is None:
            params = inspect.signature(codec.compress).parameters
            how = "seed" if "seed" in params else "generator" if "generator" in params else ""
            if not how:
                raise TypeError(f"GACT needs a seedable stochastic codec; {codec!r}.compress takes neither "
                                "seed= nor generator=")
            self._seed_style[id(codec)] = how
        if how == "seed":
            return codec.compress(x, seed=seed)
        # A CPU generator even for CUDA tensors: the codec draws one seed from it per call, and drawing
        # from a CUDA generator would synchronise the device on every pack.
        return codec.compress(x, generator=self._generator(torch.device("cpu"), seed))

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    # ------------------------------------------------------------------ passes
    @contextlib.contextmanager
    def pass_context(self) -> Iterator[SavedTensorCompressor]:
        """Install the hooks for one forward+backward. Re-entering while active is a no-op, so a probe that
        runs the training loop's own micro-batch context inside ours does not start a second pass."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self._depth = 1
        self._next_id = 0
        self.refresh_model_tensors()
        self.clear()
        self.stats = PassStats()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            self._depth = 0
            self.stats.dedup_hits = self.dedup_hits
            self.clear()  # the de-dup table references packed tensors: they must die with the graph
            self.passes += 1
            if self.recording:
                self.last_stats = self.stats
                self.peak_held_bytes = max(self.peak_held_bytes, self.stats.held_bytes)
                self.peak_raw_bytes = max(self.peak_raw_bytes, self.stats.raw_bytes)
            if self.swap is not None:
                self.swap.end_pass()

    # ------------------------------------------------------------------ hooks
    def _add_raw(self, nbytes: int) -> None:
        if not _in_backward():
            self.stats.raw_bytes += nbytes

    def _add_held(self, nbytes: int) -> None:
        if _in_backward():
            self.stats.recompute_bytes += nbytes
        else:
            self.stats.held_bytes += nbytes

    def dedup_key(self, x: torch.Tensor) -> tuple | None:
        """Only what can be packed is shared; other tensors are kept, so sharing them saves nothing."""
        if x.dtype in _QUANTIZABLE or x.dtype is torch.bool:
            return super().dedup_key(x)
        return None

    def pack(self, x: torch.Tensor) -> Any:
        """The pack hook; sparse and nested tensors are kept as they are (no codec takes them)."""
        if not isinstance(x, torch.Tensor) or x.layout is not torch.strided or x.is_nested:
            return x
        return super().pack(x)

    def store_tensor(self, x: torch.Tensor, *context: Any) -> Any:
        """Pack ``x`` as the base classifies it and file its bytes in this pass's :class:`PassStats`."""
        # The storage is counted before packing: raw bytes include what gets compressed away.
        raw = self.count_storage(x)
        self._add_raw(raw)
        stored = super().store_tensor(x, *context)
        if stored is x:
            self._add_held(raw)
            self.stats.kept_tensors += 1
        elif self.swap is not None and self.swap.active:
            self.swap.offload(stored)
            self.stats.swapped_bytes += stored.nbytes
        else:
            self._add_held(stored.nbytes)
        return stored

    def pack_mask(self, x: torch.Tensor, *context: Any) -> CompressedSavedTensor:
        """A dropout mask, 1 bit per value through the ``bitmask`` codec."""
        codec = self.codec("bitmask")
        packed = CompressedSavedTensor(codec, codec.compress(x), x, -1, 1)
        self.stats.mask_tensors += 1
        return packed

    def compress(self, x: torch.Tensor, *context: Any) -> CompressedSavedTensor | None:
        """Number ``x`` and quantize it at the bit width the controller chose for it (None: keep it)."""
        if x.dtype not in _QUANTIZABLE:  # float64 and exotic floats are kept exactly
            return None
        tid = self._next_id if x.numel() >= self.min_numel else -1
        bits = KEEP_BITS
        if tid >= 0:
            self._next_id += 1
            self.tensors[tid] = TensorInfo(tid, x.numel(), tuple(x.shape), x.dtype)
            bits = self.bits_for(tid, x.numel())
        if bits >= KEEP_BITS:
            return None
        codec = self.codec("stochastic", bits=int(bits), group_size=self.group_size)
        payload = self._compress_seeded(codec, x.detach(), self.seed_for(tid))
        self.note_nonfinite(getattr(payload, "nonfinite", None), x)
        self.stats.compressed_tensors += 1
        return CompressedSavedTensor(codec, payload, x, tid, int(bits))
