"""One megatron-core ``TransformerLayer`` forward, taken apart into the 14 ops Adacc decides on.

The ops are a faithful re-implementation of ``TransformerLayer._forward_attention`` / ``_forward_mlp``,
``SelfAttention.forward`` and ``DotProductAttention.forward`` of megatron-core 0.16.1 for the *local* layer
spec in training mode (no inference context, no packed sequences, no cross attention, no offloading). They call
the layer's own submodules and the same megatron functions in the same order, so an unmodified run through
them is bit-identical to ``layer(hidden_states, ...)`` — including the dropout masks, because the random
streams are consumed in the same order.

Each op reads named values from an environment dict and returns the values it produces:

==================  =====================================================  =================================
op                  reads                                                  writes
==================  =====================================================  =================================
layer_input         hidden_states                                          hidden_states
input_layernorm     hidden_states                                          ln1
linear_qkv          ln1, rotary_pos_emb                                    query, key, value
scores              query, key                                             scores
softmax             scores, attention_mask                                 probs
dropout             probs                                                  probs_dropped
context             probs_dropped, value                                   context
linear_proj         context                                                proj_out, proj_bias
self_attn_bda       proj_out, proj_bias, hidden_states                     attn_out
pre_mlp_layernorm   attn_out                                               ln2
linear_fc1          ln2                                                    fc1_out, fc1_bias
activation          fc1_out, fc1_bias                                      act
linear_fc2          act                                                    fc2_out, fc2_bias
mlp_bda             fc2_out, fc2_bias, attn_out                            output
==================  =====================================================  =================================

``*_bias`` values are the linear layers' bias *Parameters* (or ``None``), returned separately because
megatron builds those linears with ``skip_bias_add=True``; they are never activations. ``layer_input`` computes
nothing: it hands on the layer's input, so that the input is an op output like any other, which a decision
keeps or compresses (it is the layer's checkpoint: :mod:`megatron_adacc.adacc.policy.ops`).

That is the table of megatron's ``DotProductAttention`` (kind ``unfused``). A layer whose core attention is
:class:`~megatron_adacc.models.attention.SDPAttention` (kind ``sdpa``) keeps the 14 names, so policies, profiles
and the solvers see the same ops, but its attention is one fused kernel: ``scores``, ``softmax`` and ``dropout``
read and write nothing (they hold nothing and cost nothing), and ``context`` runs the core attention itself:

==================  =====================================================  =================================
op (sdpa)           reads                                                  writes
==================  =====================================================  =================================
scores              --                                                     --
softmax             --                                                     --
dropout             --                                                     --
context             query, key, value, attention_mask                      context
==================  =====================================================  =================================

So the q, k, v the kernel saves belong to ``linear_qkv`` (their producer), its output and log-sum-exp to
``context``, and with attention dropout on ``context`` is the op that draws random numbers.
:func:`dataflow` gives a layer's table (:class:`Dataflow`).

API for the profiler (policy helper)::

    from megatron_adacc.adacc.runtime.ops import layer_ops, initial_env, run_ops

    ops = layer_ops(layer)                     # 14 LayerOp, forward order (names = policy.ops.OP_NAMES)
    env = initial_env(hidden_states, attention_mask, rotary_pos_emb)
    for op in ops:                             # time each op, or a segment with run_ops(ops[i:j], env)
        env.update(op.run(env))
    output = env["output"]                     # == layer(hidden_states, attention_mask, ...)[0]

``LayerOp.inputs`` / ``LayerOp.outputs`` give the dataflow, e.g. to find a segment's stored inputs with
:func:`segment_inputs`. The ops mutate nothing but ``scores`` (megatron's ``attention_mask_func`` masks it
in place inside ``softmax``; re-running ``softmax`` on an already masked tensor gives the same result).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_geglu import bias_geglu_impl
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.utils import make_viewless_tensor

from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS_BY_NAME, TILED_OPS
from megatron_adacc.adacc.policy.ops import RNG_OPS as RNG_OPS_BY_KIND
from megatron_adacc.adacc.runtime.tiled import tiled_mlp
from megatron_adacc.models import SDPA, UNFUSED
from megatron_adacc.models.attention import attention_kind

Env = dict[str, Any]

#: Values the layer receives from outside (``layer_input`` hands the first on as its output).
LAYER_INPUTS: tuple[str, ...] = ("hidden_states", "attention_mask", "rotary_pos_emb")
#: The layer inputs every layer shares, which no op produces and no decision touches.
SHARED_INPUTS: tuple[str, ...] = ("attention_mask", "rotary_pos_emb")


@dataclass(frozen=True)
class LayerOp:
    """One op of one layer, bound to that layer's submodules."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable[..., dict[str, Any]]
    layer: torch.nn.Module

    def run(self, env: Env) -> dict[str, Any]:
        """Run the op on the values in ``env``; returns ``{output name: value}`` (``env`` is not modified)."""
        return self.fn(self.layer, *(env[name] for name in self.inputs))


def initial_env(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rotary_pos_emb: Any = None) -> Env:
    """The environment the first op starts from (the layer's inputs)."""
    return {"hidden_states": hidden_states, "attention_mask": attention_mask, "rotary_pos_emb": rotary_pos_emb}


def run_ops(ops: Sequence[LayerOp], env: Env) -> Env:
    """Run ``ops`` in order, adding their outputs to ``env`` (returned for convenience)."""
    for op in ops:
        env.update(op.run(env))
    return env


def segment_inputs(ops: Sequence[LayerOp] | Sequence[str], kind: str | None = None) -> tuple[str, ...]:
    """Names a run of consecutive ops (a recompute segment: :func:`megatron_adacc.adacc.policy.ops.segments`)
    reads but does not produce itself (its stored inputs), in first-use order.

    ``ops`` are :class:`LayerOp` or op names (the memory predictor has no layer); names need the layer's
    attention ``kind``, whose table (:data:`DATAFLOWS`) says what each op reads and writes.
    """
    if kind is None and any(isinstance(op, str) for op in ops):
        raise TypeError("segment_inputs of op names needs the attention kind (kind=...) whose dataflow they follow")
    produced: set[str] = set()
    needed: list[str] = []
    for op in ops:
        inputs, outputs = DATAFLOWS[kind].io[op] if isinstance(op, str) else (op.inputs, op.outputs)
        for name in inputs:
            if name not in produced and name not in needed:
                needed.append(name)
        produced.update(outputs)
    return tuple(needed)


# ----------------------------------------------------------------------------------------------- the ops
def _layer_input(layer, hidden_states):
    return {"hidden_states": hidden_states}


def _input_layernorm(layer, hidden_states):
    return {"ln1": layer.input_layernorm(hidden_states)}


def _linear_qkv(layer, ln1, rotary_pos_emb):
    attn = layer.self_attention
    config = attn.config
    # SelfAttention.forward: layers listed in no_rope_freq skip RoPE; a single embedding serves q and k.
    if config.no_rope_freq and config.no_rope_freq[attn.layer_number - 1]:
        rotary_pos_emb = None
    if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = (rotary_pos_emb,) * 2
    query, key, value = attn.get_query_key_value_tensors(ln1, None, split_qkv=True, output_gate=False)
    if rotary_pos_emb is not None:
        q_pos_emb, k_pos_emb = rotary_pos_emb
        mscale = _yarn_get_concentration_factor_from_config(config)
        if q_pos_emb is not None:
            query = apply_rotary_pos_emb(query, q_pos_emb, config=config, cu_seqlens=None, mscale=mscale,
                                         cp_group=attn.pg_collection.cp)
        if k_pos_emb is not None:
            key = apply_rotary_pos_emb(key, k_pos_emb, config=config, cu_seqlens=None, mscale=mscale,
                                       cp_group=attn.pg_collection.cp)
    return {"query": query, "key": key, "value": value}


_REPEAT_WATCHERS: list[Callable[[torch.Tensor, torch.Tensor, int], None]] = []


@contextlib.contextmanager
def watching_repeats(watcher: Callable[[torch.Tensor, torch.Tensor, int], None]) -> Iterator[None]:
    """Call ``watcher(source, repeated, groups)`` for each grouped-query repeat the unfused attention makes of K
    or V while the block runs. Megatron's ``DotProductAttention`` repeats them for its matmuls, which save the
    repeated copies; those are the source, stored once: :func:`repeat_kv` rebuilds a copy from it."""
    _REPEAT_WATCHERS.append(watcher)
    try:
        yield
    finally:
        _REPEAT_WATCHERS.remove(watcher)


def repeat_kv(source: torch.Tensor, groups: int) -> torch.Tensor:
    """K or V ``[s, b, groups of heads, head dim]`` repeated for each query head of a group, as Megatron does."""
    return source.repeat_interleave(groups, dim=2)


def repeats_kv(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s attention repeats K and V for grouped-query attention (the unfused one does; the SDPA
    kernel reads them un-repeated). Its decomposition then holds less than megatron's own forward even with every
    op kept (each repeat is stored as its source), so such a layer never runs the stock forward under a policy."""
    core = layer.self_attention.core_attention
    return (dataflow(layer).kind == UNFUSED
            and core.num_attention_heads_per_partition != core.num_query_groups_per_partition)


def _gqa_repeat(core, tensor):
    groups = core.num_attention_heads_per_partition // core.num_query_groups_per_partition
    if groups == 1:
        return tensor
    repeated = repeat_kv(tensor, groups)
    for watcher in _REPEAT_WATCHERS:
        watcher(tensor, repeated, groups)
    return repeated


def _scores(layer, query, key):
    core = layer.self_attention.core_attention
    key = _gqa_repeat(core, key)
    output_size = (query.size(1), query.size(2), query.size(0), key.size(0))  # [b, np, sq, sk]
    query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)
    key = key.view(output_size[3], output_size[0] * output_size[1], -1)
    buffer = parallel_state.get_global_memory_buffer().get_tensor(
        (output_size[0] * output_size[1], output_size[2], output_size[3]), query.dtype, "mpu")
    matmul_result = torch.baddbmm(buffer, query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2),
                                  beta=0.0, alpha=core.softmax_scale)
    return {"scores": matmul_result.view(*output_size)}


def _softmax(layer, scores, attention_mask):
    core = layer.self_attention.core_attention
    return {"probs": core.scale_mask_softmax(scores, attention_mask, core.softmax_offset)}


def _dropout(layer, probs):
    core = layer.self_attention.core_attention
    ctx = tensor_parallel.get_cuda_rng_tracker().fork() if not core.config.sequence_parallel else nullcontext()
    with ctx:
        return {"probs_dropped": core.attention_dropout(probs)}


def _context(layer, probs_dropped, value):
    core = layer.self_attention.core_attention
    value = _gqa_repeat(core, value)
    sq = probs_dropped.size(2)
    output_size = (value.size(1), value.size(2), sq, value.size(3))  # [b, np, sq, hn]
    value = value.view(value.size(0), output_size[0] * output_size[1], -1)
    probs = probs_dropped.view(output_size[0] * output_size[1], output_size[2], -1)
    context = torch.bmm(probs, value.transpose(0, 1))
    context = context.view(*output_size)
    context = context.permute(2, 0, 1, 3).contiguous()  # [sq, b, np, hn]
    context = context.view(*context.size()[:-2], core.hidden_size_per_partition)
    return {"context": context}


def _nothing(layer):
    return {}


def _sdpa_context(layer, query, key, value, attention_mask):
    # SelfAttention.forward's call of its core attention, with the mask type it passes
    attn = layer.self_attention
    return {"context": attn.core_attention(query, key, value, attention_mask, attn_mask_type=attn.attn_mask_type)}


def _linear_proj(layer, context):
    output, bias = layer.self_attention.linear_proj(context)
    return {"proj_out": output, "proj_bias": bias}


def _bda(layer, module, x, bias, residual):
    with layer.bias_dropout_add_exec_handler():
        return module(layer.training, layer.config.bias_dropout_fusion)((x, bias), residual, layer.hidden_dropout)


def _self_attn_bda(layer, proj_out, proj_bias, hidden_states):
    # The local spec's cross-attention slots are identities (checked by runtime.checks), so the output of
    # this op is what _forward_attention returns.
    return {"attn_out": _bda(layer, layer.self_attn_bda, proj_out, proj_bias, hidden_states)}


def _pre_mlp_layernorm(layer, attn_out):
    return {"ln2": layer.pre_mlp_layernorm(attn_out)}


def _linear_fc1(layer, ln2):
    out, bias = layer.mlp.linear_fc1(ln2)
    return {"fc1_out": out, "fc1_bias": bias}


def _activation(layer, fc1_out, fc1_bias):
    """MLP.forward's activation branch (no TE activation, no per-token scale)."""
    mlp = layer.mlp
    config = mlp.config
    x, bias = fc1_out, fc1_bias
    if config.bias_activation_fusion:
        if mlp.activation_func == F.gelu:
            if config.gated_linear_unit:
                x = bias_geglu_impl(x, bias)
            else:
                x = bias_gelu_impl(x, bias)
        elif mlp.activation_func == F.silu and config.gated_linear_unit:
            x = bias_swiglu_impl(x, bias, config.activation_func_fp8_input_store, False)
        else:
            raise ValueError("Only support fusion of gelu and swiglu")
    else:
        if bias is not None:
            x = x + bias
        if config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(x, 2, dim=-1)
            if (val := config.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            x = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
        else:
            x = mlp.activation_func(x)
    return {"act": x}


def _linear_fc2(layer, act):
    out, bias = layer.mlp.linear_fc2(act)
    return {"fc2_out": out, "fc2_bias": bias}


def _mlp_bda(layer, fc2_out, fc2_bias, attn_out):
    hidden = _bda(layer, layer.mlp_bda, fc2_out, fc2_bias, attn_out)
    return {"output": make_viewless_tensor(inp=hidden, requires_grad=hidden.requires_grad, keep_graph=True)}


Row = tuple[str, tuple[str, ...], tuple[str, ...], Callable[..., dict[str, Any]]]

_TABLE: tuple[Row, ...] = (
    ("layer_input", ("hidden_states",), ("hidden_states",), _layer_input),
    ("input_layernorm", ("hidden_states",), ("ln1",), _input_layernorm),
    ("linear_qkv", ("ln1", "rotary_pos_emb"), ("query", "key", "value"), _linear_qkv),
    ("scores", ("query", "key"), ("scores",), _scores),
    ("softmax", ("scores", "attention_mask"), ("probs",), _softmax),
    ("dropout", ("probs",), ("probs_dropped",), _dropout),
    ("context", ("probs_dropped", "value"), ("context",), _context),
    ("linear_proj", ("context",), ("proj_out", "proj_bias"), _linear_proj),
    ("self_attn_bda", ("proj_out", "proj_bias", "hidden_states"), ("attn_out",), _self_attn_bda),
    ("pre_mlp_layernorm", ("attn_out",), ("ln2",), _pre_mlp_layernorm),
    ("linear_fc1", ("ln2",), ("fc1_out", "fc1_bias"), _linear_fc1),
    ("activation", ("fc1_out", "fc1_bias"), ("act",), _activation),
    ("linear_fc2", ("act",), ("fc2_out", "fc2_bias"), _linear_fc2),
    ("mlp_bda", ("fc2_out", "fc2_bias", "attn_out"), ("output",), _mlp_bda),
)

#: The fused kernel replaces the attention's four ops: three empty ones, and ``context`` running the kernel.
_SDPA_ROWS: dict[str, Row] = {
    "scores": ("scores", (), (), _nothing),
    "softmax": ("softmax", (), (), _nothing),
    "dropout": ("dropout", (), (), _nothing),
    "context": ("context", ("query", "key", "value", "attention_mask"), ("context",), _sdpa_context),
}


class Dataflow:
    """The op table of one attention kind: what each op reads and writes, who produces each value, and which
    ops draw from a random generator when dropout is on (their re-runs need the saved RNG states)."""

    def __init__(self, kind: str, table: Sequence[Row], rng_ops: frozenset[str]):
        assert tuple(row[0] for row in table) == OP_NAMES, "runtime ops out of sync with adacc.policy.ops"
        self.kind = kind
        self.table = tuple(table)
        self.rng_ops = rng_ops
        #: Output name -> the op that produces it.
        self.producer: dict[str, str] = {out: row[0] for row in self.table for out in row[2]}
        #: Op name -> (inputs, outputs).
        self.io: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {row[0]: (row[1], row[2]) for row in self.table}
        assert all(set(self.reads_past(name)) <= set(OPS_BY_NAME[name].reads) for name in OP_NAMES), (
            "an op reads an output past the op before it that adacc.policy.ops does not declare in its reads")

    def reads_past(self, name: str) -> tuple[str, ...]:
        """The ops, besides the one right before op ``name`` (and itself), whose outputs it reads: what the cost
        model knows as :attr:`~megatron_adacc.adacc.policy.ops.OpSpec.reads`."""
        before = OP_NAMES[max(OP_NAMES.index(name) - 1, 0)]
        found = (self.producer.get(value) for value in self.io[name][0])
        return tuple(dict.fromkeys(op for op in found if op is not None and op not in (before, name)))


DATAFLOWS: dict[str, Dataflow] = {
    UNFUSED: Dataflow(UNFUSED, _TABLE, RNG_OPS_BY_KIND[UNFUSED]),
    SDPA: Dataflow(SDPA, [_SDPA_ROWS.get(row[0], row) for row in _TABLE], RNG_OPS_BY_KIND[SDPA]),
}

#: Output name -> producing op of the unfused table (the attention without a kernel).
PRODUCER: dict[str, str] = DATAFLOWS[UNFUSED].producer
#: The unfused table's random ops: also, in either table, the ops whose own saved floats are dropout multipliers
#: (the SDPA kernel draws in ``context`` but saves no mask: a CUDA kernel keeps its Philox seed, and on the CPU
#: attention dropout is refused).
RNG_OPS: frozenset[str] = DATAFLOWS[UNFUSED].rng_ops


def dataflow(layer: torch.nn.Module) -> Dataflow:
    """The op table of ``layer``, chosen by its core attention (``DotProductAttention`` or ``SDPAttention``)."""
    kind = attention_kind(layer.self_attention.core_attention)
    if kind is None:
        raise TypeError(f"core attention {type(layer.self_attention.core_attention).__name__} has no Adacc op "
                        "table (check_layer refuses such a layer before it runs)")
    return DATAFLOWS[kind]


def mlp_functions(layer: torch.nn.Module) -> tuple[Callable[..., dict[str, Any]], ...]:
    """The op functions of the MLP's token-wise ops (:data:`TILED_OPS`), what :func:`.tiled.tiled_mlp` runs."""
    rows = {row[0]: row for row in dataflow(layer).table}
    return tuple(rows[name][3] for name in TILED_OPS)


def layer_ops(layer: torch.nn.Module, tiles: int = 1) -> list[LayerOp]:
    """The 14 ops of ``layer`` in forward order (see the module docstring for their dataflow).

    With ``tiles`` > 1 the MLP's token-wise ops run as one block re-run in that many token tiles in backward
    (:mod:`.tiled`): ``linear_fc1`` and ``activation`` read and write nothing, and ``linear_fc2`` reads ``ln2``
    and runs the block."""
    table = dataflow(layer).table
    if tiles > 1:
        rows = {row[0]: row for row in table}
        block = functools.partial(tiled_mlp, tiles=tiles, ops=mlp_functions(layer))
        tiled = {TILED_OPS[0]: (TILED_OPS[0], (), (), _nothing), TILED_OPS[1]: (TILED_OPS[1], (), (), _nothing),
                 TILED_OPS[2]: (TILED_OPS[2], rows[TILED_OPS[0]][1], rows[TILED_OPS[2]][2], block)}
        table = tuple(tiled.get(row[0], row) for row in table)
    return [LayerOp(name, inputs, outputs, fn, layer) for name, inputs, outputs, fn in table]
