"""The policy-driven checkpoint function: one ``TransformerLayer`` forward with per-op keep / compress / recompute.

How it works
------------
The layer runs as its 14 ops (:mod:`megatron_adacc.adacc.runtime.ops`), each under ``saved_tensors_hooks``. Every
tensor autograd saves is attributed to the op that *produced its storage* (so ``linear_qkv``'s input, which
is ``input_layernorm``'s output, belongs to ``input_layernorm``); a tensor no op produced (a layernorm's
mean, a dropout mask) belongs to the op that is running, but for the unfused attention's grouped-query repeats
of K and V, which belong to (and are stored as) their source, repeated again when backward reads them. The
decision of that op then applies:

* ``keep``      — the tensor is stored as it is;
* ``compress``  — the tensor is stored as the codec's ``Packed`` and decompressed when backward needs it. No
  host read: NaN/Inf inputs are flagged on the device and told at the step's end
  (:data:`~megatron_adacc.core.saved.NONFINITE`), outlier-separated INT4 stores up to a capacity learned from
  the previous step (:mod:`.capacity`). Dropout masks go to a lossless 1-bit codec whatever the codec named
  (:class:`MaskCodec`), as in section 3.2 of the paper; statistics, tables and scalars too small to gain from
  compression are kept (:func:`small_tensor_numel`); the codec reads a tensor in its memory layout, so the
  channels of Q, K and V are the head dimension (:class:`InMemoryOrder`);
* ``recompute`` — only a small token is stored. Consecutive recomputed ops form one *segment*. At the
  segment's start the runtime stores the segment's inputs (as their producers' decisions say: a reference,
  a ``Packed``, or a token into an earlier segment) and, when the segment draws random numbers, Megatron's
  RNG states (default generator, "CUDA" state and the tracker states). The first token unpacked in backward
  re-runs the segment from those inputs under the saved RNG states, so dropout masks are replayed exactly,
  and resolves every live token of the segment at once.

Parameters and the inputs every layer shares (attention mask, rotary embedding) are never touched. The hidden
states the layer receives are the output of its first op, ``layer_input``, the layer's checkpoint: kept, or
compressed once however many nodes save them (the first norm and, when it is recomputed, its segment's input).

Memory: everything stored is owned by autograd's saved variables (through the tokens), so it is freed as
backward consumes it. A segment and its stored inputs die with its last token. During the forward, op
outputs no later op reads are dropped as soon as they are dead, like the stock forward's locals, so the
transient peak matches Megatron's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.tensor_parallel.random import _fork_rng, _get_all_rng_states, _set_all_rng_states

from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS_BY_NAME, OUTLIER_CODEC, Action, segments
from megatron_adacc.adacc.policy.policy import Decision, check_tiles, held_action
from megatron_adacc.adacc.runtime import accounting, stages
from megatron_adacc.adacc.runtime.capacity import CAPACITIES
from megatron_adacc.adacc.runtime.ops import (
    LAYER_INPUTS,
    PRODUCER,
    RNG_OPS,
    SHARED_INPUTS,
    LayerOp,
    dataflow,
    initial_env,
    layer_ops,
    repeat_kv,
    run_ops,
    segment_inputs,
    watching_repeats,
)
from megatron_adacc.codecs import get_codec
from megatron_adacc.codecs.base import compress_with, mark_nonfinite
from megatron_adacc.core import saved as saved_module
from megatron_adacc.core.saved import (
    SavedHandle,
    SavedTensorStore,
    storage_ptr,
    tensor_key,
    unique_storage_bytes,
)

# ------------------------------------------------------------------------------------------------ codecs
_CODEC_CACHE: dict[tuple, Any] = {}


def codec_for(name: str, params: Mapping[str, Any]) -> Any:
    """A cached codec instance for ``name`` with ``params`` (``megatron_adacc.codecs.get_codec``)."""
    key = (name, tuple(sorted(params.items())))
    codec = _CODEC_CACHE.get(key)
    if codec is None:
        codec = _CODEC_CACHE[key] = get_codec(name, **dict(params))
    return codec


class _MaskPacked:
    """A dropout mask as one bit per value, plus the value of the kept entries for float masks (a 0-d device
    tensor) and the device flag saying the float tensor was no such mask."""

    __slots__ = ("bits", "scale", "dtype", "found")

    def __init__(self, bits: Any, scale: torch.Tensor | None, dtype: torch.dtype, flag: torch.Tensor | None = None):
        self.bits, self.scale, self.dtype = bits, scale, dtype
        self.found = {} if flag is None else {"nonfinite": flag}

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    @property
    def nonfinite(self) -> torch.Tensor | None:
        return self.found.get("nonfinite")


class MaskCodec:
    """Lossless 1-bit storage of dropout masks (section 3.2: "we compress the original byte format to bit format").

    A bool mask (what ``native_dropout`` saves on a GPU) goes to the ``bitmask`` codec as it is. On the CPU,
    torch's dropout saves the float multiplier ``bernoulli(1-p) / (1-p)`` instead, whose entries are all 0 or
    one value ``1/(1-p)``: it is stored as the bitmask of its non-zeros plus that value (its maximum, kept on the
    device), and restored exactly. The float tensors an RNG op saves internally are such multipliers (the ops'
    dropout is the only one that saves a float it made); that is checked on the device, not read: a tensor with
    other values is flagged like a NaN/Inf one and decompresses with a NaN, so it cannot pass unnoticed.
    """

    def compress(self, t: torch.Tensor) -> _MaskPacked:
        bits = codec_for("bitmask", {})
        if t.dtype == torch.bool:
            return _MaskPacked(compress_with(bits, t), None, t.dtype)
        kept = t != 0
        scale = t.amax() if t.numel() else t.new_ones(())
        # Runs inside the forward at every dropout: one more bool temporary (anded in place), no gathering of the
        # non-zeros; ``kept & (t != scale)`` would hold a third mask-sized one.
        stray = t != scale
        stray &= kept
        flag = stray.any().reshape(1) | ~torch.isfinite(scale).reshape(1)
        del stray
        return _MaskPacked(compress_with(bits, kept), scale, t.dtype, flag)

    def decompress(self, p: _MaskPacked) -> torch.Tensor:
        mask = codec_for("bitmask", {}).decompress(p.bits)
        if p.scale is None:
            return mask
        # in place: a float mask is as large as the activation it drops, and backward is where memory peaks
        return mark_nonfinite(mask.to(p.dtype).mul_(p.scale), p.nonfinite)


MASK_CODEC = MaskCodec()


def small_tensor_numel(layer: torch.nn.Module, hidden_states: torch.Tensor) -> int:
    """Saved float tensors of ``layer`` with fewer elements are kept, whatever the decision (:func:`compress_float`).

    That is at most one value per token and attention head (norm means and reciprocal deviations, the SDPA
    kernel's log-sum-exp) or less than one head's activation, tokens x head dimension (RoPE's cos/sin tables,
    scalars). Compressing them saves next to nothing (the outlier codec stores more than a one-channel input),
    and a quantized statistic would scale every gradient that reads it. The smallest activation, one key/value
    head of multi-query attention, is tokens x head dimension: compressed while heads < head dimension, as in
    every GPT and Llama shape."""
    attn = layer.self_attention
    tokens = hidden_states.numel() // max(hidden_states.size(-1), 1)
    heads = attn.num_attention_heads_per_partition
    return tokens * max(heads + 1, attn.hidden_size_per_attention_head)


def compress_tensor(t: torch.Tensor, op: str, is_output: bool, decision: Any,
                    small_numel: int = 0) -> tuple[Any, Any] | None:
    """Compress one saved tensor of ``op`` under a compress ``decision``: ``(codec, packed)``, or None to keep it.

    * bool masks, and the float dropout multipliers an RNG op saves internally, go to the lossless
      :class:`MaskCodec` (whatever the decision's codec);
    * float tensors of fewer than ``small_numel`` elements are kept (:func:`small_tensor_numel`), and so is
      everything that is not such a mask with the ``bitmask`` codec;
    * other float tensors go to the decision's codec in their memory layout (:class:`InMemoryOrder`; NaN/Inf
      input is flagged in ``packed.found``);
    * other dtypes (indices) are kept.
    """
    if t.dtype == torch.bool:
        return MASK_CODEC, MASK_CODEC.compress(t)
    if not t.is_floating_point():
        return None
    return compress_float(t, op, is_output, decision, small_numel=small_numel)


def compress_float(t: torch.Tensor, op: str, is_output: bool, decision: Any,
                   place: tuple | None = None, small_numel: int = 0) -> tuple[Any, Any] | None:
    """:func:`compress_tensor` for a floating ``t``: the float dropout multiplier an RNG op saves internally
    goes to :class:`MaskCodec`; a tensor under ``small_numel`` elements, and with the ``bitmask`` codec anything
    else, is kept (None). With ``place`` (where in the model ``t`` is saved), outlier-separated INT4 runs at the
    place's learned capacity (:mod:`.capacity`), with no host read; without, it selects exactly (one read)."""
    if not is_output and op in RNG_OPS:
        return MASK_CODEC, MASK_CODEC.compress(t)
    if decision.codec == "bitmask" or t.numel() < small_numel:
        return None
    codec = codec_for(decision.codec, decision.codec_params)
    t, codec = InMemoryOrder.wrap(t, codec)
    if place is not None and decision.codec == OUTLIER_CODEC:
        return codec, CAPACITIES.compress(codec, t, place)
    return codec, compress_with(codec, t)


class InMemoryOrder:
    """A codec fed a tensor with its dimensions in memory order, outermost first, and its decompressed tensor
    permuted back.

    The codecs' channels are the last dimension, which should be the one contiguous in memory: the head
    dimension of Q, K and V, however the attention transposes them (the unfused scores save K as a [b x heads,
    head dim, s] view, whose last dimension would make sequence positions channels; the SDPA kernel saves
    [b, heads, s, head dim] views of [s, b, heads, head dim] tensors). The permuted view needs no copy for a
    dense tensor, so the codec reads memory in order; a tensor already in memory order goes to the codec itself.
    """

    __slots__ = ("codec", "inverse")

    def __init__(self, codec: Any, inverse: tuple[int, ...]):
        self.codec, self.inverse = codec, inverse

    @classmethod
    def wrap(cls, t: torch.Tensor, codec: Any) -> tuple[torch.Tensor, Any]:
        """``(t with its dimensions in memory order, the codec that restores t's order)``."""
        if t.is_contiguous():
            return t, codec
        order = memory_order(t)
        inverse = tuple(sorted(range(t.dim()), key=order.__getitem__))
        return t.permute(order), cls(codec, inverse)

    @property
    def name(self) -> str:
        return self.codec.name

    def compress(self, t: torch.Tensor, **kwargs: Any) -> Any:
        return self.codec.compress(t, **kwargs)

    def decompress(self, packed: Any) -> torch.Tensor:
        return self.codec.decompress(packed).permute(self.inverse)

    # sizing a tensor without data (codecs.base.compress_with): the permuted shape has the same bytes
    def compressed_nbytes(self, shape: Any, dtype: torch.dtype, **data_dependent: Any) -> int:
        return self.codec.compressed_nbytes(shape, dtype, **data_dependent)

    def assumed_data(self, shape: Any) -> dict[str, Any]:
        return self.codec.assumed_data(shape)


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from the largest stride to the smallest, size-1 dimensions (any stride) first and ties
    in their own order: ``t.permute(memory_order(t))`` of a dense tensor is contiguous, and its last dimension is
    never a size-1 one unless every dimension is."""
    return tuple(sorted(range(t.dim()), key=lambda d: (t.size(d) != 1, -t.stride(d), d)))


# ------------------------------------------------------------------------------------------------ handles
class _Handle(SavedHandle):
    """What a pack hook returns instead of a tensor; ``unpack()`` gives the tensor back."""

    __slots__ = ()


class _Compressed(_Handle):
    """A compressed tensor. Saved twice (an op output two autograd nodes save, or one node saving it twice), it
    is packed once, and unpacked once for as long as the first copy lives: autograd unpacks every saved tensor of
    a node when it runs, and a second decompressed copy in that backward would cost its full size again."""

    __slots__ = ("codec", "packed", "op", "_copy")

    def __init__(self, codec: Any, packed: Any, op: str):
        self.codec, self.packed, self.op = codec, packed, op
        self._copy: weakref.ref | None = None

    def unpack(self) -> torch.Tensor:
        copy = self._copy() if self._copy is not None else None
        if copy is None:
            copy = self.codec.decompress(self.packed)
            self._copy = weakref.ref(copy)
        return copy


class _Recomputed(_Handle):
    """A token for a tensor that the segment recomputes in backward.

    ``key`` is ``("view", output_name, size, stride, storage_offset)`` for (a view of) an op output, or
    ``("internal", op_name, pack_index)`` for a tensor an op saved that is not an op output.
    """

    __slots__ = ("segment", "key", "value")

    def __init__(self, segment: _Segment, key: tuple):
        self.segment, self.key, self.value = segment, key, None

    def unpack(self) -> torch.Tensor:
        if self.value is None:
            self.segment.materialize()
        return self.value


class _Repeated(_Handle):
    """A view of K or V repeated for grouped-query attention, stored as its source (kept, compressed or a token
    into a recompute segment, as the source's op decides) and repeated again when backward reads it."""

    __slots__ = ("source", "groups", "geometry")

    def __init__(self, source: Any, groups: int, view: torch.Tensor):
        self.source, self.groups = source, groups
        self.geometry = (tuple(view.size()), view.stride(), view.storage_offset())

    def unpack(self) -> torch.Tensor:
        # a fresh repeat is laid out as the forward's was (contiguous, its own storage), so the view's geometry holds
        return repeat_kv(_unpack(self.source), self.groups).as_strided(*self.geometry)


_unpack = SavedTensorStore.unpack


def never_unpacked(_obj: Any) -> None:  # pragma: no cover - such a graph is never backpropagated
    """The unpack hook of a forward whose graph is only measured or re-run for its values (a recomputation,
    layer-size profiling): its pack hook keeps nothing, so autograd holds no tensor and no cycle through them."""
    raise RuntimeError("megatron-adacc: a graph run only for its values was backpropagated; this is a bug")


@contextlib.contextmanager
def _replay_rng(states: tuple | None):
    """Run under the RNG states captured in forward, and restore the current ones afterwards."""
    if states is None:
        yield
        return
    cpu, cuda, tracker = states
    with _fork_rng():
        # A copy of the tracker dict: set_states() adopts the dict, and forks inside the re-run update it.
        _set_all_rng_states(cpu, cuda, dict(tracker))
        yield


def _capture_rng() -> tuple:
    cpu, cuda, tracker = _get_all_rng_states()
    return cpu, cuda, dict(tracker)


def rng_state_nbytes(states: tuple) -> int:
    """Bytes held by one captured RNG state tuple."""
    cpu, cuda, tracker = states
    return unique_storage_bytes([cpu, cuda, *tracker.values()])


# ------------------------------------------------------------------------------------------------ segments
_CHANGED_BY_READER = frozenset(value for value, op in PRODUCER.items() if OPS_BY_NAME[op].changed_by_reader)
@dataclass
class _StashEntry:
    value: Any                 # a tensor, a _Handle, a Parameter or None
    requires_grad: bool


class _Segment:
    """A run of consecutive recomputed ops, re-run once in backward from its stored inputs."""

    def __init__(self, ops: Sequence[LayerOp], rng_ops: frozenset[str]):
        self.ops = list(ops)
        self.names = [op.name for op in ops]
        self.handles: weakref.WeakSet[_Recomputed] = weakref.WeakSet()
        self.packed_tokens = 0  # tokens held by saved variables (the stash of a later segment may hold more)
        self.stash: dict[str, _StashEntry] | None = None
        self.rng: tuple | None = None
        self.needs_rng = any(op.name in rng_ops for op in ops)

    def _inputs(self) -> dict[str, Any]:
        env: dict[str, Any] = {}
        for name, entry in self.stash.items():
            value = _unpack(entry.value)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                value = value.detach()
                if entry.requires_grad:
                    value.requires_grad_(True)
                if name in _CHANGED_BY_READER:
                    # softmax masks its input in place (megatron's attention_mask_func); in-place ops on a
                    # leaf that requires grad are refused, and the stored scores must stay intact.
                    value = value.clone()
            env[name] = value
        return env

    def materialize(self) -> None:
        """Re-run the segment and resolve every live token (called by the first token unpacked)."""
        live = [h for h in self.handles if h.value is None]
        if not live:
            return
        if self.stash is None:
            raise RuntimeError(
                "megatron-adacc: a recompute segment was unpacked after its inputs were released "
                "(a second backward through the same graph needs retain_graph=True on the first one)"
            )
        wanted = {h.key for h in live if h.key[0] == "internal"}
        captured: dict[tuple, torch.Tensor] = {}
        cursor = {"op": "", "index": 0}

        def pack(t: torch.Tensor) -> None:
            key = ("internal", cursor["op"], cursor["index"])
            cursor["index"] += 1
            if key in wanted:
                captured[key] = t.detach()
            return None

        # Values no later op of the segment reads and no token wants die as the segment runs, as in the
        # forward: the re-run should not hold more than the tensors it brings back.
        wanted_outputs = {h.key[1] for h in live if h.key[0] == "view"}
        last_read = {name: i for i, op in enumerate(self.ops) for name in op.inputs}
        with torch.enable_grad(), _replay_rng(self.rng):
            env = self._inputs()  # under enable_grad: backward runs with grad mode off
            for i, op in enumerate(self.ops):
                cursor["op"], cursor["index"] = op.name, 0
                with torch.autograd.graph.saved_tensors_hooks(pack, never_unpacked):
                    env.update(op.run(env))
                for name in [n for n in env if last_read.get(n, -1) <= i and n not in wanted_outputs]:
                    del env[name]
        for h in live:
            if h.key[0] == "internal":
                if h.key not in captured:
                    raise RuntimeError(f"megatron-adacc: recomputing {self.names} did not save {h.key}; the "
                                       "forward and its re-run diverged (a data-dependent branch?)")
                h.value = captured[h.key]
            else:
                _, name, size, stride, offset = h.key
                h.value = env[name].detach().as_strided(size, stride, offset)
        # Every token is resolved; the inputs and RNG states are no longer needed.
        self.stash = None
        self.rng = None


# ------------------------------------------------------------------------------------------------ frame
@dataclass
class LayerMemory:
    """Bytes one layer holds for backward after its forward, measured by the runtime (unique storages)."""

    layer: int
    input_bytes: int = 0
    """The layer's input, filed apart only by a layer that runs megatron's own forward (:attr:`stock_bytes`);
    the runtime files it under op ``layer_input`` (kept or compressed)."""
    per_op: dict[str, int] = field(default_factory=lambda: {name: 0 for name in OP_NAMES})
    stash_bytes: int = 0
    rng_bytes: int = 0
    stock_bytes: int = 0
    """Saved by a layer whose policy keeps everything, which runs megatron's own forward
    (:func:`stock_layer_forward`): not split by op."""
    shared: dict[int, int] = field(default_factory=dict)
    """Storages of inputs every layer shares (attention mask, rotary embedding) that ops saved: held once for
    the whole model, so they are not part of :attr:`total_bytes`; ``{storage id: bytes}`` to sum uniquely."""

    @property
    def total_bytes(self) -> int:
        return self.input_bytes + sum(self.per_op.values()) + self.stash_bytes + self.rng_bytes + self.stock_bytes


class _Frame(SavedTensorStore):
    """The state of one layer forward under a policy (dropped when the forward returns).

    The store's rules are those of the ``compress`` decision: dropout masks go to :class:`MaskCodec`, the codecs'
    NaN/Inf flags go to :data:`~megatron_adacc.core.saved.NONFINITE` (named by layer and op), an op output saved
    twice is compressed once. Storages kept for backward are counted in the store's ledger under the op they
    belong to.
    """

    # Only op outputs are de-duplicated, and release() retires them when they die.
    weak_dedup = False

    def __init__(self, layer: torch.nn.Module, decisions: Mapping[str, Any], ops: Sequence[LayerOp],
                 small_numel: int = 0):
        super().__init__(layer.parameters())
        self.small_numel = small_numel
        self._layer_number = getattr(layer, "layer_number", "?")
        self.decisions = decisions
        self.ops = ops
        self.flow = dataflow(layer)
        self.external: set[int] = set()
        self.producer: dict[int, tuple[str, str]] = {}
        self.packed_handles: dict[int, _Compressed] = {}     # payloads a saved variable references
        self.shared: dict[int, int] = {}                      # layer inputs saved as they are (storage -> bytes)
        self.actions = {name: held_action(d) for name, d in decisions.items()}
        self.segment_of: dict[str, _Segment] = {}
        self.segments: list[_Segment] = []
        for run in segments(self.actions[op.name] == Action.RECOMPUTE for op in ops):
            seg = _Segment([ops[i] for i in run], self.flow.rng_ops)
            self.segments.append(seg)
            for op in seg.ops:
                self.segment_of[op.name] = seg
        self.current_op = ""
        self.pack_index = 0
        self.repeats: dict[int, tuple[torch.Tensor, int]] = {}
        """Grouped-query repeats of K and V the running op made: ``{storage: (source, groups)}``."""

    def note_repeat(self, source: torch.Tensor, repeated: torch.Tensor, groups: int) -> None:
        """A repeat of ``source`` (:func:`~.ops.watching_repeats`), saved by the op that made it."""
        self.repeats[storage_ptr(repeated)] = (source, groups)

    # -- storing one tensor under the decision of the op that owns it
    def _keep(self, t: torch.Tensor, op: str, from_pack: bool) -> torch.Tensor:
        if from_pack:
            self.count_storage(t, op)
        return t

    def pack_mask(self, t: torch.Tensor, op: str, is_output: bool) -> _Compressed:
        return _Compressed(MASK_CODEC, MASK_CODEC.compress(t), op)

    def compress(self, t: torch.Tensor, op: str, is_output: bool) -> _Compressed | None:
        return compressed_at(self._layer_number, t, op, is_output, self.decisions[op], self.small_numel)

    def _compress(self, t: torch.Tensor, op: str, is_output: bool, from_pack: bool) -> Any:
        # Deduplicate only tensors whose storage the layer's environment keeps alive for the whole forward
        # (op outputs and their views). An op's internal tensor (a dropout mask) dies once compressed, and
        # the allocator may hand its address to the next tensor, so its geometry is no identity.
        handle = self.save(t, tensor_key(t) if is_output else None, op, is_output)
        if isinstance(handle, torch.Tensor):
            return self._keep(t, op, from_pack)
        if from_pack:
            self.packed_handles[id(handle)] = handle
        return handle

    def store(self, t: torch.Tensor, op: str, output_name: str | None, index: int, from_pack: bool) -> Any:
        action = self.actions[op]
        if action == Action.KEEP:
            return self._keep(t, op, from_pack)
        if action == Action.COMPRESS:
            return self._compress(t, op, output_name is not None, from_pack)
        seg = self.segment_of[op]
        if output_name is not None:
            key = ("view", output_name, tuple(t.size()), t.stride(), t.storage_offset())
        else:
            key = ("internal", op, index)
        handle = _Recomputed(seg, key)
        seg.handles.add(handle)
        if from_pack:
            seg.packed_tokens += 1
        return handle

    def pack(self, t: torch.Tensor) -> Any:
        index = self.pack_index
        self.pack_index += 1
        if self.is_model_tensor(t):
            return t
        ptr = storage_ptr(t)
        if ptr in self.external:
            self.shared.setdefault(ptr, t.untyped_storage().nbytes())
            return t
        repeat = self.repeats.get(ptr)
        if repeat is not None and storage_ptr(repeat[0]) in self.producer:
            source, groups = repeat
            owner = self.producer[storage_ptr(source)]
            return _Repeated(self.store(source, owner[0], owner[1], index, True), groups, t)
        owner = self.producer.get(ptr)
        if owner is None:
            return self.store(t, self.current_op, None, index, True)
        return self.store(t, owner[0], owner[1], index, True)

    def stash_value(self, name: str, value: Any) -> _StashEntry:
        """Store a segment input the way its producer's decision says."""
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter) or name in SHARED_INPUTS:
            return _StashEntry(value, bool(getattr(value, "requires_grad", False)))
        op = self.flow.producer[name]
        return _StashEntry(self.store(value, op, name, -1, False), value.requires_grad)

    def release(self, env: dict[str, Any], names: Sequence[str]) -> None:
        """Drop op outputs no later op reads, as the stock forward's locals go out of scope.

        A storage nothing else holds (no kept saved tensor, no stored segment input, no other live output) is
        freed by this, and the allocator may hand its address to a later tensor: forget it in the producer
        and dedup tables, so that address is not mistaken for it.
        """
        released = []
        for name in names:
            value = env.pop(name, None)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                released.append(storage_ptr(value))
        if not released:
            return
        live = {storage_ptr(v) for v in env.values() if isinstance(v, torch.Tensor)}
        for seg in self.segments:
            for entry in (seg.stash or {}).values():
                if isinstance(entry.value, torch.Tensor):
                    live.add(storage_ptr(entry.value))
        for ptr in released:
            if ptr in live or ptr in self.storages or ptr in self.model_storages or ptr in self.external:
                continue
            self.producer.pop(ptr, None)
            self.forget(ptr)

    def site_key(self) -> Any:  # the layer's name is formatted only for a NaN/Inf line, not at every save
        return self._layer_number

    @classmethod
    def format_site(cls, key: Any) -> str:
        return f"layer {key}"

    def register_outputs(self, op: str, outputs: Mapping[str, Any]) -> None:
        for name, value in outputs.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                ptr = storage_ptr(value)
                if ptr not in self.model_storages and ptr not in self.external:
                    self.producer.setdefault(ptr, (op, name))


def checkpointed_layer_forward(
    layer: torch.nn.Module,
    decisions: Mapping[str, Any],
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    rotary_pos_emb: Any = None,
    *,
    layer_index: int | None = None,
) -> torch.Tensor:
    """Run ``layer`` (a megatron-core ``TransformerLayer``, local spec, training mode) under ``decisions``.

    Args:
        layer: the transformer layer.
        decisions: ``{op name: Decision}`` for the 14 ops of :data:`megatron_adacc.adacc.policy.ops.OP_NAMES`
            (e.g. ``policy.layer_decisions(i)``); a ``Decision`` has ``action`` in keep / compress / recompute,
            and ``codec`` / ``codec_params`` for compress.
        hidden_states, attention_mask, rotary_pos_emb: the layer's inputs, as ``TransformerLayer.forward``.
        layer_index: 0-based index used to file the measured memory (:func:`.memory.memory_report`).

    Returns:
        The layer's output hidden states (``layer(...)[0]``).
    """
    missing = [name for name in OP_NAMES if name not in decisions]
    if missing:
        raise ValueError(f"decisions for ops {missing} are missing; give one Decision per op of {OP_NAMES}")
    ops = layer_ops(layer, check_tiles(decisions))
    env = initial_env(hidden_states, attention_mask, rotary_pos_emb)
    if not torch.is_grad_enabled():
        return run_ops(ops, env)["output"]

    stuck = [op.name for op in ops if decisions[op.name].action == Action.RECOMPUTE
             and not OPS_BY_NAME[op.name].recomputable]
    if stuck:
        raise ValueError(f"op {stuck[0]!r} is the layer's checkpoint: keep or compress it, never recompute it")
    frame = _Frame(layer, decisions, ops, small_tensor_numel(layer, hidden_states))
    for value in (attention_mask, *_flatten(rotary_pos_emb)):
        if isinstance(value, torch.Tensor):
            frame.external.add(storage_ptr(value))

    def pack(t: torch.Tensor) -> Any:
        return frame.pack(t)

    last_use = _last_uses(ops)
    trace = stages.active()
    for index, op in enumerate(ops):
        seg = frame.segment_of.get(op.name)
        if seg is not None and seg.ops[0] is op:
            seg.stash = {name: frame.stash_value(name, env[name]) for name in segment_inputs(seg.ops)}
            if seg.needs_rng:
                seg.rng = _capture_rng()
        frame.current_op, frame.pack_index = op.name, 0
        if trace is not None:
            trace.enter_forward(layer_index, op.name)
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), watching_repeats(frame.note_repeat):
            outputs = op.run(env)
        frame.repeats.clear()  # a repeat is saved by the op that makes it; its address may be reused after
        env.update(outputs)
        frame.register_outputs(op.name, outputs)
        if trace is not None:
            trace.mark(layer_index, op.name, outputs)
        frame.release(env, last_use.get(index, ()))
    output = env["output"]
    if trace is not None:
        trace.enter_forward(None, None)

    if accounting.is_enabled():
        accounting.record(_measure(frame, layer_index))
    return output


def stock_layer_forward(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    rotary_pos_emb: Any = None,
    *,
    layer_index: int | None = None,
) -> torch.Tensor:
    """Run ``layer`` through megatron's own ``TransformerLayer.forward``, for a layer whose policy keeps every
    activation: the op decomposition and its per-tensor bookkeeping buy nothing there and cost a few percent
    of step time. With accounting on, a plain pack hook files what the layer saves, as
    :func:`checkpointed_layer_forward` does."""

    if stages.active() is not None and torch.is_grad_enabled():
        # a backward trace reports op by op: the decomposition runs the same ops and saves the same tensors
        return checkpointed_layer_forward(layer, _KEEP_ALL, hidden_states, attention_mask, rotary_pos_emb,
                                          layer_index=layer_index)

    def call() -> torch.Tensor:
        out = layer(hidden_states=hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return out[0] if isinstance(out, tuple) else out

    if not (accounting.is_enabled() and torch.is_grad_enabled()):
        return call()
    kept = SavedTensorStore(layer.parameters())  # only its parameter rule and storage ledger are used
    external = {storage_ptr(v) for v in (attention_mask, *_flatten(rotary_pos_emb)) if isinstance(v, torch.Tensor)}
    own_input = storage_ptr(hidden_states)
    shared: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = storage_ptr(t)
        if ptr != own_input and not kept.is_model_tensor(t):
            if ptr in external:
                shared[ptr] = t.untyped_storage().nbytes()
            else:
                kept.count_storage(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
        output = call()
    accounting.record(LayerMemory(layer=-1 if layer_index is None else layer_index,
                                  input_bytes=hidden_states.untyped_storage().nbytes(),
                                  stock_bytes=kept.storage_bytes, shared=shared))
    return output


def recomputes_whole_layer(layer: torch.nn.Module, decisions: Mapping[str, Any]) -> bool:
    """Whether ``decisions`` store the layer input (kept, or compressed) and recompute, untiled, every op of
    ``layer`` that computes anything (the SDPA kernel's layer has no separate scores, softmax and dropout): what
    Megatron's full recompute does to one layer, which :func:`recomputed_layer_forward` then runs. Not with a
    compressed input that megatron splits across tensor-parallel ranks (``distribute_saved_activations``): the
    codecs' channels would be a flat chunk's."""
    stored = decisions["layer_input"].action
    if stored != Action.KEEP and (stored != Action.COMPRESS or layer.config.distribute_saved_activations):
        return False
    return all(decisions[name].action == Action.RECOMPUTE and decisions[name].tiles == 1
               for name, inputs, outputs, _ in dataflow(layer).table[1:] if inputs or outputs)


def recomputed_layer_forward(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    rotary_pos_emb: Any = None,
    *,
    layer_index: int | None = None,
    decisions: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Run ``layer`` under megatron's own full recompute (``tensor_parallel.checkpoint``, as
    ``TransformerBlock._checkpointed_forward`` calls it for one layer), for a layer whose policy stores its input
    and recomputes everything else (:func:`recomputes_whole_layer`; ``decisions`` None: the input kept): the same
    bytes as the runtime's decomposition (the input and one copy of the RNG states), without its per-op
    bookkeeping, whose cost is most of a recomputed layer's on a small model. With the input kept, training is
    megatron's full recompute's bit for bit; compressed, the checkpoint's saved input is packed by the input's
    codec (at its learned outlier capacity, NaN/Inf flagged) and decompressed for the re-run, as the
    decomposition stores it: the floor below full recompute at full recompute's speed."""
    from megatron.core import tensor_parallel

    decisions = decisions or _RECOMPUTE_ALL
    if stages.active() is not None and torch.is_grad_enabled():
        # a backward trace reports op by op: the decomposition holds the same bytes and re-runs the same ops
        return checkpointed_layer_forward(layer, decisions, hidden_states, attention_mask, rotary_pos_emb,
                                          layer_index=layer_index)

    def run(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
        # These hooks take every tensor the layer saves, in its no-grad forward (which still packs what the
        # scripted bias-dropout-add would save, and nothing keeps) and in its re-run in backward (what backward
        # holds for a moment), so that no outer meter counts them, as the decomposition's own hooks take its ops'.
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            return layer(hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                         context_mask=context_mask, rotary_pos_emb=rotary_pos_emb)

    stored = _StoredInput(layer, hidden_states, decisions["layer_input"])
    with torch.autograd.graph.saved_tensors_hooks(stored.pack, _unpack):  # the checkpoint's own inputs
        out = tensor_parallel.checkpoint(run, layer.config.distribute_saved_activations, hidden_states,
                                         attention_mask, None, None, rotary_pos_emb)
    output = out[0] if isinstance(out, tuple) else out
    node = output.grad_fn
    if accounting.is_enabled() and node is not None:
        # What its context (the graph node) holds: its inputs, of which the layer's own (read after the call:
        # split across tensor-parallel ranks when megatron distributes saved activations) is this layer's, and
        # the RNG states it captured.
        memory = LayerMemory(layer=-1 if layer_index is None else layer_index,
                             rng_bytes=rng_state_nbytes(node.rng_states))
        if stored.packed_bytes is None:
            memory.input_bytes = hidden_states.untyped_storage().nbytes()
        else:  # filed as the decomposition files a compressed input
            memory.per_op["layer_input"] = stored.packed_bytes
        accounting.record(memory)
    return output


class _StoredInput:
    """The pack hook of a checkpoint's saved inputs: the layer's own compressed under a compress ``decision``
    (:func:`compress_float`, at the place the decomposition compresses it), every other one as it is."""

    def __init__(self, layer: torch.nn.Module, hidden_states: torch.Tensor, decision: Any):
        self.layer, self.input, self.decision = layer, hidden_states, decision
        self.packed_bytes: int | None = None

    def pack(self, t: torch.Tensor) -> Any:
        # megatron's checkpoint saves its arguments themselves: the input is this very tensor object
        if t is not self.input or self.decision.action != Action.COMPRESS:
            return t
        handle = compressed_at(getattr(self.layer, "layer_number", "?"), t, "layer_input", True, self.decision,
                               small_tensor_numel(self.layer, t))
        if handle is None:
            return t
        self.packed_bytes = handle.packed.nbytes
        return handle


def compressed_at(layer_number: Any, t: torch.Tensor, op: str, is_output: bool, decision: Any,
                  small_numel: int) -> _Compressed | None:
    """``t``, saved by ``op`` of layer ``layer_number``, compressed under ``decision`` (:func:`compress_float`,
    at that place's learned outlier capacity), its NaN/Inf flag handed to :data:`~megatron_adacc.core.saved.
    NONFINITE` under the layer and op; None to keep it. One place for the decomposition and megatron's checkpoint."""
    result = compress_float(t, op, is_output, decision, (layer_number, op, is_output, tuple(t.shape)), small_numel)
    if result is None:
        return None
    if result[1].nonfinite is not None:
        dtype, shape = t.dtype, tuple(t.shape)
        saved_module.NONFINITE.note(result[1].nonfinite,
                                    lambda: _Frame.describe_site(layer_number, op, dtype, shape))
    return _Compressed(result[0], result[1], op)


_KEEP_ALL = {name: Decision.keep() for name in OP_NAMES}
_RECOMPUTE_ALL = {name: Decision.keep() if name == "layer_input" else Decision.recompute() for name in OP_NAMES}


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _last_uses(ops: Sequence[LayerOp]) -> dict[int, tuple[str, ...]]:
    """``{op index: op outputs last read by that op}`` (layer inputs and the layer output are never released)."""
    last: dict[str, int] = {}
    for index, op in enumerate(ops):
        for name in op.inputs:
            if name not in LAYER_INPUTS:
                last[name] = index
    out: dict[int, list[str]] = {}
    for name, index in last.items():
        out.setdefault(index, []).append(name)
    return {index: tuple(names) for index, names in out.items()}


def _flatten(value: Any) -> list:
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _flatten(item)]
    return [value]


def _measure(frame: _Frame, layer_index: int | None) -> LayerMemory:
    """What stays held for backward: kept storages and packed payloads referenced by saved variables, and
    the stored inputs and RNG states of the segments that still have tokens (their own, or a later
    segment's stored input)."""
    mem = LayerMemory(layer=-1 if layer_index is None else layer_index)
    seen: set[int] = set()
    for ptr, kept in frame.storages.items():
        if ptr not in seen:
            seen.add(ptr)
            mem.per_op[kept.owner] += kept.nbytes
    for handle in frame.packed_handles.values():
        mem.per_op[handle.op] += handle.packed.nbytes
    counted = set(frame.packed_handles)
    live: set[int] = set()
    for seg in reversed(frame.segments):  # a segment lives if saved variables or a live later segment need it
        if seg.packed_tokens or id(seg) in live:
            live.add(id(seg))
            for entry in (seg.stash or {}).values():
                if isinstance(entry.value, _Recomputed):
                    live.add(id(entry.value.segment))
    for seg in frame.segments:
        if seg.stash is None or id(seg) not in live:
            continue
        for entry in seg.stash.values():
            value = entry.value
            if isinstance(value, _Compressed):
                if id(value) not in counted:
                    counted.add(id(value))
                    mem.stash_bytes += value.packed.nbytes
            elif isinstance(value, torch.Tensor) and not frame.is_model_tensor(value):
                if storage_ptr(value) not in frame.external:
                    mem.stash_bytes += unique_storage_bytes([value], seen)
        if seg.rng is not None:
            mem.rng_bytes += rng_state_nbytes(seg.rng)
    mem.shared = dict(frame.shared)
    return mem
