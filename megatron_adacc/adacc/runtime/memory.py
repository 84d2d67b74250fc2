"""Per-op activation sizes, the memory a policy is predicted to hold, and the measured-vs-predicted report.

``profile_layer_sizes`` runs one forward of a layer with every op kept and records, per op, what autograd
saves and the runtime would attribute to it (the same attribution as the checkpoint function): the bytes of
its unique storages, how many tensors, and their compressed sizes for the codecs asked for. It also records,
per op output, what storing it as a *segment input* would add (nothing when the tensor is already saved).

``predict_layer_memory(decisions, sizes)`` turns those sizes and a layer's decisions into a
:class:`~megatron_adacc.adacc.runtime.checkpoint.LayerMemory`, following the runtime's rules exactly:

* keep: the op's saved bytes; compress: their packed bytes (non-float tensors stay kept); recompute: 0;
* each recompute segment that still has tokens after forward (its ops saved something, or a later live
  segment reads one of its outputs) holds its inputs (when not already saved) and, when it contains an op that
  draws random numbers (a dropout; with SDPA attention, ``context``), one copy of Megatron's RNG states;
* the layer input is op ``layer_input``'s output, held as that op decides (it is the layer's checkpoint).

So the prediction and the runtime's measurement agree exactly on the batch that was profiled; on other batches
they differ only by data-dependent codec sizes (outlier channels: the runtime stores up to a capacity learned
from the previous step, :mod:`.capacity`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.tensor_parallel.random import _fork_rng

from megatron_adacc.adacc.policy.ops import OP_NAMES, Action, segments
from megatron_adacc.adacc.policy.policy import Decision, held_action
from megatron_adacc.adacc.runtime import accounting
from megatron_adacc.adacc.runtime.checkpoint import (
    LayerMemory,
    _capture_rng,
    compress_tensor,
    never_unpacked,
    rng_state_nbytes,
    small_tensor_numel,
)
from megatron_adacc.adacc.runtime.ops import (
    DATAFLOWS,
    SHARED_INPUTS,
    dataflow,
    initial_env,
    layer_ops,
    segment_inputs,
    watching_repeats,
)
from megatron_adacc.core.saved import storage_ptr, tensor_key, unique_storage_bytes
from megatron_adacc.models import UNFUSED

CodecKey = tuple  # (codec name, sorted params)


def codec_key(name: str, params: Mapping[str, Any]) -> CodecKey:
    return (name, tuple(sorted(dict(params).items())))


@dataclass
class OpSizes:
    """What one op's output (and the op's own saved tensors) weighs for backward, from a profiled forward."""

    saved_bytes: int = 0
    """Unique storages the op owns among the saved tensors (the ``keep`` cost)."""
    saved_count: int = 0
    """Saved tensors attributed to the op (a recomputed op with 0 leaves no token)."""
    output_bytes: int = 0
    """Unique storages of the op's outputs (the paper's M_i when every output were stored)."""
    compressed_bytes: dict[CodecKey, int] = field(default_factory=dict)
    """The ``compress`` cost per codec."""
    stash_keep_bytes: dict[str, int] = field(default_factory=dict)
    """Per output: extra bytes to hold it as a segment input when the op is kept (0 if already saved)."""
    stash_compressed_bytes: dict[str, dict[CodecKey, int]] = field(default_factory=dict)
    """Per output and codec: extra packed bytes to hold it as a segment input when the op is compressed."""
    readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per output: the ops that read it. A recompute segment holding one of them, and not the op itself, holds the
    output as its stored input (the stash)."""
    value_bytes: dict[str, int] = field(default_factory=dict)
    """Per output: its bytes at full size (a view's own elements), what a re-run decompresses of it."""
    consumer_bytes: dict[str, int] = field(default_factory=dict)
    """Per op whose backward reads them: the bytes of this op's saved storages that op saved (a compressed tensor
    is decompressed in the backward of each)."""
    freed_bytes: dict[str, int] = field(default_factory=dict)
    """Per op: the bytes of this op's saved storages freed after that op's backward, the earliest (in forward
    order) of those reading them (autograd frees a saved storage with the last node holding it)."""
    grad_bytes: int = 0
    """Gradients live during this op's backward whatever the policy: of its outputs (arriving) and of the
    activations it reads (being written)."""

    def compress_cost(self, key: CodecKey) -> int:
        if key not in self.compressed_bytes:
            raise KeyError(f"codec {key[0]} with params {dict(key[1])} was not profiled for this op; pass it in "
                           "`codecs` to profile_layer_sizes")
        return self.compressed_bytes[key]


@dataclass
class LayerSizes:
    """Per-op sizes of one layer for one input shape."""

    ops: dict[str, OpSizes]
    input_bytes: int
    """The layer input's storage (op ``layer_input`` files what of it is saved)."""
    rng_bytes: int
    """Bytes of one captured set of RNG states (default generator, "CUDA" state, tracker states)."""
    kind: str = UNFUSED
    """The layer's attention kind: whose op table (:data:`~megatron_adacc.adacc.runtime.ops.DATAFLOWS`) says
    what a recompute segment reads and which ops draw random numbers."""

    def to_json(self) -> dict[str, Any]:
        return {
            "input_bytes": self.input_bytes,
            "rng_bytes": self.rng_bytes,
            "ops": {name: {"saved_bytes": s.saved_bytes, "saved_count": s.saved_count,
                           "output_bytes": s.output_bytes,
                           "compressed_bytes": {k[0]: v for k, v in s.compressed_bytes.items()}}
                    for name, s in self.ops.items()},
        }


def _codecs_of(decisions: Mapping[str, Any]) -> dict[str, set[CodecKey]]:
    out: dict[str, set[CodecKey]] = {name: set() for name in OP_NAMES}
    for name, d in decisions.items():
        if d.action == Action.COMPRESS:
            out[name].add(codec_key(d.codec, d.codec_params))
    return out


class _SavedRecorder:
    """The pack hook of :func:`profile_layer_sizes`: which op owns each tensor autograd saves, and who read it."""

    def __init__(self, params: set[int], external: set[int]) -> None:
        self.params, self.external = params, external
        self.producer: dict[int, tuple[str, str]] = {}
        # op -> dedup key -> (tensor, is an op output)
        self.saved: dict[str, dict[tuple, tuple[torch.Tensor, bool]]] = {name: {} for name in OP_NAMES}
        # owner op -> consumer op -> the owner's tensors that consumer's autograd nodes saved
        self.consumed: dict[str, dict[str, list[torch.Tensor]]] = {name: {} for name in OP_NAMES}
        self.counts = {name: 0 for name in OP_NAMES}
        self.current = ""
        self.repeats: dict[int, torch.Tensor] = {}  # the running op's grouped-query repeats -> their source

    def note_repeat(self, source: torch.Tensor, repeated: torch.Tensor, groups: int) -> None:
        self.repeats[storage_ptr(repeated)] = source

    def pack(self, t: torch.Tensor) -> None:
        """Record ``t``, and give autograd nothing to keep: this graph is never backpropagated, and a tensor
        a node keeps (say softmax's output, kept by its own node) would hold that node alive, a cycle through
        C++ that Python's collector cannot see."""
        ptr = storage_ptr(t)
        source = self.repeats.get(ptr)
        if source is not None and storage_ptr(source) in self.producer:  # the runtime stores the source instead
            t, ptr = source, storage_ptr(source)
        if ptr in self.params or ptr in self.external or isinstance(t, torch.nn.Parameter):
            return None
        owner, name = self.producer.get(ptr, (self.current, None))
        self.counts[owner] += 1
        # Mirror the runtime: only op outputs (alive for the whole forward) are deduplicated by geometry.
        key = tensor_key(t) if name is not None else ("internal", self.counts[owner])
        self.saved[owner].setdefault(key, (t, name is not None))
        self.consumed[owner].setdefault(self.current, []).append(t)
        return None

    def produced(self, op: str, outputs: Mapping[str, Any]) -> None:
        for name, value in outputs.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                ptr = storage_ptr(value)
                if ptr not in self.params and ptr not in self.external:
                    self.producer.setdefault(ptr, (op, name))

    def release(self) -> None:
        """Drop every tensor. Autograd keeps this hook in every node that saved a tensor, and the hook keeps
        the saved tensors, whose nodes these are: another cycle. With either, each layer's profiled forward
        stayed resident for the whole run (tiny: 64 MiB)."""
        self.saved.clear()
        self.consumed.clear()
        self.producer.clear()


def profile_layer_sizes(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    rotary_pos_emb: Any = None,
    codecs: Mapping[str, Iterable[CodecKey]] | None = None,
) -> LayerSizes:
    """Run ``layer`` once with every op kept and measure each op's sizes (RNG states are left untouched).

    The input requires grad whatever ``hidden_states`` does, as every layer's input does in training: autograd
    saves what the input's gradient needs only when it is wanted (an RMSNorm's input and ``rstd``, half a
    residual stream per layer that a detached sample would leave out of every kept ``input_layernorm``).

    ``codecs`` maps op names to the codec keys (:func:`codec_key`) to measure for that op; e.g.
    ``_codecs_of(policy.layer_decisions(i))``.
    """
    codecs = {name: set(codecs.get(name, ())) if codecs else set() for name in OP_NAMES}
    ops = layer_ops(layer)
    inputs = hidden_states.detach().requires_grad_(True)
    external = {storage_ptr(t) for t in (attention_mask, *_flat(rotary_pos_emb)) if isinstance(t, torch.Tensor)}
    recorder = _SavedRecorder({storage_ptr(p) for p in layer.parameters()}, external)
    env = initial_env(inputs, attention_mask, rotary_pos_emb)
    sizes = {name: OpSizes() for name in OP_NAMES}
    try:
        with _fork_rng(), torch.enable_grad():
            rng_bytes = rng_state_nbytes(_capture_rng())
            for op in ops:
                recorder.current = op.name
                with (torch.autograd.graph.saved_tensors_hooks(recorder.pack, never_unpacked),
                      watching_repeats(recorder.note_repeat)):
                    outputs = op.run(env)
                recorder.repeats.clear()
                sizes[op.name].grad_bytes = _grad_bytes([env[n] for n in op.inputs] + list(outputs.values()))
                env.update(outputs)
                recorder.produced(op.name, outputs)
        small = small_tensor_numel(layer, hidden_states)
        readers: dict[str, list[str]] = {}
        for op in ops:
            for name in op.inputs:
                readers.setdefault(name, []).append(op.name)
        for op in ops:
            _op_sizes(sizes[op.name], op, env, recorder, codecs[op.name], small, readers)
    finally:
        recorder.release()
        env.clear()
    return LayerSizes(ops=sizes, input_bytes=hidden_states.untyped_storage().nbytes(), rng_bytes=rng_bytes,
                      kind=dataflow(layer).kind)


def _op_sizes(s: OpSizes, op: Any, env: Mapping[str, Any], recorder: _SavedRecorder,
              codecs: set[CodecKey], small_numel: int, readers: Mapping[str, list[str]]) -> None:
    """Fill one op's sizes from what its forward saved and produced (``readers``: value name -> the ops that read
    it)."""
    name = op.name
    tensors = recorder.saved[name]
    saved_ptrs = {storage_ptr(t) for t, _ in tensors.values()}
    s.saved_bytes = unique_storage_bytes(t for t, _ in tensors.values())
    s.saved_count = recorder.counts[name]
    s.consumer_bytes = {consumer: unique_storage_bytes(ts) for consumer, ts in recorder.consumed[name].items()}
    s.freed_bytes = _freed_bytes(recorder.consumed[name])
    outs = [env[o] for o in op.outputs if isinstance(env[o], torch.Tensor)
            and not isinstance(env[o], torch.nn.Parameter)]
    s.output_bytes = unique_storage_bytes(outs)
    for key in codecs:
        s.compressed_bytes[key] = _packed_bytes(tensors.values(), name, key, small_numel)
    for out_name in op.outputs:
        value = env[out_name]
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        ptr = storage_ptr(value)
        s.value_bytes[out_name] = value.numel() * value.element_size()
        s.readers[out_name] = tuple(r for r in readers.get(out_name, ()) if r != name)
        s.stash_keep_bytes[out_name] = 0 if ptr in saved_ptrs else value.untyped_storage().nbytes()
        s.stash_compressed_bytes[out_name] = {
            key: 0 if tensor_key(value) in tensors else _packed_bytes([(value, True)], name, key, small_numel)
            for key in codecs
        }


def _freed_bytes(consumed: Mapping[str, list[torch.Tensor]]) -> dict[str, int]:
    """``{op: bytes}``: each storage in ``consumed`` (readers' op name -> tensors) under its earliest reader."""
    first: dict[int, tuple[int, torch.Tensor]] = {}
    for consumer, tensors in consumed.items():
        order = OP_NAMES.index(consumer)
        for t in tensors:
            ptr = storage_ptr(t)
            if ptr not in first or order < first[ptr][0]:
                first[ptr] = (order, t)
    out: dict[str, int] = {}
    for order, t in first.values():
        name = OP_NAMES[order]
        out[name] = out.get(name, 0) + unique_storage_bytes([t])
    return out


def _grad_bytes(values: Iterable[Any]) -> int:
    """Bytes of the gradients of ``values`` that are activations (float tensors requiring grad, not parameters)."""
    return unique_storage_bytes(v for v in _flat(list(values)) if isinstance(v, torch.Tensor) and v.requires_grad
                                and not isinstance(v, torch.nn.Parameter))


def _packed_bytes(entries: Iterable[tuple[torch.Tensor, bool]], op: str, key: CodecKey, small_numel: int) -> int:
    """Bytes the runtime holds when op ``op`` compresses ``entries`` ((tensor, is an op output) pairs) with
    codec ``key``: the same per-tensor routing as the runtime (:func:`compress_tensor`, small tensors kept)."""
    decision = Decision(Action.COMPRESS, key[0], dict(key[1]))
    total = 0
    kept: list[torch.Tensor] = []
    for t, is_output in entries:
        result = compress_tensor(t.detach(), op, is_output, decision, small_numel)
        if result is None:
            kept.append(t)
        else:
            total += result[1].nbytes
    return total + unique_storage_bytes(kept)


def _flat(value: Any) -> list:
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _flat(item)]
    return [value]


def predict_layer_memory(decisions: Mapping[str, Any], sizes: LayerSizes, layer: int = -1) -> LayerMemory:
    """The bytes a layer run under ``decisions`` holds for backward, from its profiled ``sizes``."""
    mem = LayerMemory(layer=layer)
    for name in OP_NAMES:
        d = decisions[name]
        s = sizes.ops[name]
        if d.action == Action.KEEP:
            mem.per_op[name] = s.saved_bytes
        elif d.action == Action.COMPRESS:
            mem.per_op[name] = s.compress_cost(codec_key(d.codec, d.codec_params))
    held = {name: held_action(d) for name, d in decisions.items()}
    segs = [[OP_NAMES[i] for i in run] for run in segments(held[name] == Action.RECOMPUTE for name in OP_NAMES)]
    seg_of = {name: i for i, seg in enumerate(segs) for name in seg}
    flow = DATAFLOWS[sizes.kind]
    producers = flow.producer
    live: set[int] = set()
    for i in reversed(range(len(segs))):
        seg = segs[i]
        if any(sizes.ops[name].saved_count for name in seg) or i in live:
            live.add(i)
            for value in segment_inputs(seg, sizes.kind):
                if value in producers and producers[value] in seg_of:
                    live.add(seg_of[producers[value]])
    for i in sorted(live):
        seg = segs[i]
        for value in segment_inputs(seg, sizes.kind):
            if value in SHARED_INPUTS or value not in producers:
                continue
            producer = producers[value]
            d = decisions[producer]
            s = sizes.ops[producer]
            if value not in s.stash_keep_bytes:  # a Parameter (bias) or None
                continue
            if held[producer] == Action.KEEP:
                mem.stash_bytes += s.stash_keep_bytes[value]
            elif d.action == Action.COMPRESS:
                mem.stash_bytes += s.stash_compressed_bytes[value][codec_key(d.codec, d.codec_params)]
        if any(name in flow.rng_ops for name in seg):
            mem.rng_bytes += sizes.rng_bytes
    return mem


# ------------------------------------------------------------------------------------------------ report
def memory_report(policy: Any = None) -> dict[str, Any]:
    """Measured (and, where sizes were profiled, predicted) bytes held for backward per layer.

    Returns ``{"layers": [{"layer", "measured_bytes", "predicted_bytes", "rel_error", "measured",
    "predicted"}...], "measured_bytes", "predicted_bytes", "shared_bytes"}`` for the most recent forward of
    each layer run through the runtime (``shared_bytes``: inputs all layers share, such as the attention mask,
    counted once and not in the per-layer figures). ``policy`` defaults to the installed one.
    """
    if policy is None:
        policy = accounting.policy()
    rows = []
    for index, measured in accounting.latest().items():
        row: dict[str, Any] = {"layer": index, "measured_bytes": measured.total_bytes, "measured": measured}
        sizes = accounting.sizes().get(index)
        # A preset name stays a string until the first forward sizes it; then it is a Policy.
        if sizes is not None and hasattr(policy, "layer_decisions") and 0 <= index < policy.num_layers:
            predicted = predict_layer_memory(policy.layer_decisions(index), sizes, index)
            row["predicted_bytes"] = predicted.total_bytes
            row["predicted"] = predicted
            row["rel_error"] = abs(measured.total_bytes - predicted.total_bytes) / max(predicted.total_bytes, 1)
        rows.append(row)
    shared: dict[int, int] = {}
    for row in rows:
        shared.update(row["measured"].shared)
    out: dict[str, Any] = {"layers": rows, "measured_bytes": sum(r["measured_bytes"] for r in rows),
                           "shared_bytes": sum(shared.values())}
    if rows and all("predicted_bytes" in r for r in rows):
        out["predicted_bytes"] = sum(r["predicted_bytes"] for r in rows)
    return out
