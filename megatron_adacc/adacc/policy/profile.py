"""Profile data model: what the profiler measured for one transformer layer of one model on one device.

Times are seconds for one micro-batch through one layer; bytes are per layer. ``crate`` follows the paper's
CRate_i: compressed bytes / original bytes (a fraction, so memory = M_i x CRate_i).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS

PROFILE_VERSION = 10
"""The profile format. Profiles of another version are not migrated: :meth:`LayerProfile.from_json` refuses
them and the database skips them, so the caller profiles again. The number goes up whenever old profiles would
mislead the cost model: 2 made ``workspace_bytes`` only the policy-independent transient (version 1 also
counted one layer's activations, which the cost model now derives per policy); 3 added ``runtime_overhead_s``,
the runtime's fixed per-layer cost, and times ``step_time_s`` through megatron's own forward; 4 added each op's
``consumers``, ``freed``, ``grad_bytes`` and ``output_bytes``, from which the cost model bounds every backward stage;
5 made the layer input an op (``layer_input``, kept or compressed) instead of ``layer_fixed_bytes``, kept codecs off
small tensors and fed them tensors in memory order; 6 added each op's ``forward_bytes``; 7 split each op's stash
by output, with the ops reading each (``stash``), so a segment that reads an output past the ops between them
(the attention's q, k and v) holds it too; 8 kept the codec times of an op that saves nothing (they are measured
on its outputs, which a segment's stash compresses), which earlier versions zeroed; 9 calibrates codec and
recompute times and the runtime's overhead from alternating runs (earlier ones, timed one variant after the other,
could read a host's slow-down as any of them), and measures the tiled MLP re-run's cost per tile
(``tile_overhead_s``); 10 sizes the ops with an input that wants its gradient, as in training (version 9's
detached sample left an RMSNorm's saved input and ``rstd`` out of ``input_layernorm``: half a residual stream per
kept layer short, which the process calibration then added to every policy), and measures megatron's own full
recompute of a layer (``layer_recompute_s``), which a policy recomputing the whole layer now runs."""


@dataclass
class CodecProfile:
    """One codec applied to one op's output."""

    compressed_bytes: int
    compress_time_s: float
    decompress_time_s: float
    stats: dict[str, Any] = field(default_factory=dict)
    """Data-dependent statistics, e.g. ``outlier_channels`` and ``channels`` for ``int4_outlier``."""

    def to_json(self) -> dict[str, Any]:
        return {"compressed_bytes": int(self.compressed_bytes), "compress_time_s": float(self.compress_time_s),
                "decompress_time_s": float(self.decompress_time_s), "stats": dict(self.stats)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CodecProfile:
        return cls(int(obj["compressed_bytes"]), float(obj["compress_time_s"]), float(obj["decompress_time_s"]),
                   dict(obj.get("stats", {})))


@dataclass(frozen=True)
class StashedOutput:
    """One output of an op as the stored input of a recompute segment that reads it."""

    readers: tuple[str, ...]
    """The ops that read it: a segment holding one of them, and not the op, holds the output until it re-runs."""
    bytes: dict[str, int]
    """Extra bytes to hold it, per storage of the op (``keep`` or a codec name); 0 when saved for backward anyway."""
    output_bytes: int
    """Its bytes at full size: what the re-run decompresses of it when the op is compressed."""

    def to_json(self) -> dict[str, Any]:
        return {"readers": list(self.readers), "bytes": {k: int(v) for k, v in self.bytes.items()},
                "output_bytes": int(self.output_bytes)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StashedOutput:
        return cls(tuple(str(r) for r in obj["readers"]), {str(k): int(v) for k, v in obj["bytes"].items()},
                   int(obj["output_bytes"]))


@dataclass
class OpProfile:
    """One op's output activation: size, time to (re)compute, and every applicable codec measured."""

    name: str
    saved_bytes: int
    """M_i: bytes the output holds for backward when kept."""
    forward_time_s: float
    """T_comp_i: time to recompute the op from its stored inputs."""
    codecs: dict[str, CodecProfile] = field(default_factory=dict)
    stash: list[StashedOutput] = field(default_factory=list)
    """Its outputs as the stored inputs of the recompute segments that read them. Empty: nothing is held
    (shape-formula and synthetic profiles)."""
    consumers: dict[str, int] | None = None
    """``{op name: bytes}``: the ops whose backward reads what this op holds, with the bytes each reads (a
    compressed tensor is decompressed in each). None: read by the next op only (shape-formula and synthetic
    profiles)."""
    grad_bytes: int = 0
    """Gradients live during this op's backward whatever the policy (of its outputs and of what it reads)."""
    freed: dict[str, int] | None = None
    """``{op name: bytes}``: what autograd frees of this op's bytes after that op's backward (each storage after its
    earliest reader's). None: all of them after the next op's."""
    output_bytes: int | None = None
    """The op's outputs at full size (what a recompute segment starting after it materializes again when the op
    is compressed). None: its saved bytes."""
    forward_bytes: int | None = None
    """What the op's forward has live at its peak beyond what it reads: its outputs, what it saves and its
    temporaries (a dropout's mask beside its output). None: not measured (the cost model then bounds no forward)."""

    def crate(self, codec: str) -> float:
        """CRate of ``codec`` on this op (compressed / original bytes)."""
        if self.saved_bytes <= 0:
            return 0.0
        return self.codecs[codec].compressed_bytes / self.saved_bytes

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "saved_bytes": int(self.saved_bytes), "forward_time_s": float(self.forward_time_s),
                "codecs": {k: v.to_json() for k, v in self.codecs.items()},
                "stash": [out.to_json() for out in self.stash],
                "consumers": None if self.consumers is None else {k: int(v) for k, v in self.consumers.items()},
                "freed": None if self.freed is None else {k: int(v) for k, v in self.freed.items()},
                "grad_bytes": int(self.grad_bytes),
                "output_bytes": None if self.output_bytes is None else int(self.output_bytes),
                "forward_bytes": None if self.forward_bytes is None else int(self.forward_bytes)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> OpProfile:
        def by_op(key: str) -> dict[str, int] | None:
            value = obj.get(key)
            return None if value is None else {str(k): int(v) for k, v in value.items()}

        return cls(str(obj["name"]), int(obj["saved_bytes"]), float(obj["forward_time_s"]),
                   {k: CodecProfile.from_json(v) for k, v in obj.get("codecs", {}).items()},
                   [StashedOutput.from_json(out) for out in obj.get("stash", [])],
                   by_op("consumers"), int(obj.get("grad_bytes", 0)), by_op("freed"),
                   None if obj.get("output_bytes") is None else int(obj["output_bytes"]),
                   None if obj.get("forward_bytes") is None else int(obj["forward_bytes"]))


@dataclass
class LayerProfile:
    """The profile of one transformer layer (all layers of a GPT stage are identical)."""

    device: str
    signature: dict[str, Any]
    ops: list[OpProfile]
    static_bytes: int = 0
    """M_static: parameters, gradients and optimizer states (and anything else not an activation)."""
    workspace_bytes: int = 0
    """Policy-independent transient memory on top of the stored activations at the peak (the logits and
    their gradient); the bytes a layer re-materializes in backward are added per policy by the cost model."""
    rng_bytes: int = 0
    """One saved copy of the RNG states, held by each recompute segment that contains a dropout op."""
    segment_times_s: dict[tuple[int, int], float] = field(default_factory=dict)
    """Measured time to recompute ops ``a..b`` (inclusive, 0-based op indices) as one segment from the
    stored input of op ``a``; missing segments are estimated by the cost model."""
    segment_overhead_s: float = 0.0
    """Fixed cost of launching one recompute segment (RNG restore, re-entry), used for unmeasured segments."""
    step_time_s: float | None = None
    """Measured time of one layer's forward + backward through megatron's own forward, if known."""
    codec_time_scale: float = 1.0
    """Measured / modeled overhead of compressing every op, from timing one layer's forward + backward under
    the runtime (keep-all against compress-all). Per-op codec micro-benchmarks run on cache-hot tensors and
    leave out the runtime's own work (pack hooks, mask packing, allocating outputs), so the cost model
    scales every codec time by this."""
    recompute_time_scale: float = 1.0
    """The same calibration for recomputation (keep-all against recompute-all)."""
    runtime_overhead_s: float = 0.0
    """Fixed cost of running one layer's forward + backward through Adacc's op decomposition instead of
    megatron's own forward (measured: the runtime keeping everything against the stock layer). A layer whose
    policy keeps every activation runs the stock forward and does not pay it."""
    tile_overhead_s: float = 0.0
    """What re-running the MLP in token tiles (:mod:`megatron_adacc.adacc.runtime.tiled`) costs per tile beyond
    the first, over the untiled re-run (measured: the tiled block's forward + backward against one tile's). The
    arithmetic is the same; each tile's calls and autograd pass are not, and on a small layer they dominate."""
    layer_recompute_s: float | None = None
    """What megatron's own full recompute of one layer adds to its stock forward + backward: the time of a layer
    whose policy keeps its input and recomputes everything else, which runs that way
    (:func:`~megatron_adacc.adacc.runtime.checkpoint.recomputed_layer_forward`). None: not measured (the cost
    model then prices such a layer as the runtime's decomposition of it)."""
    source: str = "measured"
    """``measured`` (the profiler), ``analytic`` (shape formulas) or ``synthetic`` (tests)."""
    created_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [op.name for op in self.ops]
        if names != list(OP_NAMES):
            raise ValueError(f"profile ops {names} do not match the layer's ops {list(OP_NAMES)}")

    def op(self, name: str) -> OpProfile:
        return self.ops[OP_NAMES.index(name)]

    def segment_time(self, a: int, b: int) -> float:
        """Time to recompute ops ``a..b`` as one segment: measured when available, else the per-op sum plus
        the per-segment overhead."""
        if (a, b) in self.segment_times_s:
            return self.segment_times_s[(a, b)]
        return sum(op.forward_time_s for op in self.ops[a:b + 1]) + self.segment_overhead_s

    def scaled_segment_time(self, a: int, b: int) -> float:
        """:meth:`segment_time` calibrated by :attr:`recompute_time_scale` (what the cost model uses)."""
        return self.segment_time(a, b) * self.recompute_time_scale

    def to_json(self) -> dict[str, Any]:
        return {
            "profile_version": PROFILE_VERSION,
            "device": self.device,
            "signature": dict(self.signature),
            "ops": [op.to_json() for op in self.ops],
            "static_bytes": int(self.static_bytes),
            "workspace_bytes": int(self.workspace_bytes),
            "rng_bytes": int(self.rng_bytes),
            "segment_times_s": [[a, b, t] for (a, b), t in sorted(self.segment_times_s.items())],
            "segment_overhead_s": self.segment_overhead_s,
            "step_time_s": self.step_time_s,
            "codec_time_scale": self.codec_time_scale,
            "recompute_time_scale": self.recompute_time_scale,
            "runtime_overhead_s": self.runtime_overhead_s,
            "tile_overhead_s": self.tile_overhead_s,
            "layer_recompute_s": self.layer_recompute_s,
            "source": self.source,
            "created_at": self.created_at,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LayerProfile:
        if obj.get("profile_version") != PROFILE_VERSION:
            raise ValueError(f"profile version {obj.get('profile_version')!r} is not {PROFILE_VERSION}; "
                             "re-run `adacc profile`")
        return cls(
            device=obj["device"], signature=dict(obj["signature"]),
            ops=[OpProfile.from_json(o) for o in obj["ops"]],
            static_bytes=int(obj.get("static_bytes", 0)), workspace_bytes=int(obj.get("workspace_bytes", 0)),
            rng_bytes=int(obj.get("rng_bytes", 0)),
            segment_times_s={(int(a), int(b)): float(t) for a, b, t in obj.get("segment_times_s", [])},
            segment_overhead_s=float(obj.get("segment_overhead_s", 0.0)),
            step_time_s=obj.get("step_time_s"), source=obj.get("source", "measured"),
            codec_time_scale=float(obj.get("codec_time_scale", 1.0)),
            recompute_time_scale=float(obj.get("recompute_time_scale", 1.0)),
            runtime_overhead_s=float(obj.get("runtime_overhead_s", 0.0)),
            tile_overhead_s=float(obj.get("tile_overhead_s", 0.0)),
            layer_recompute_s=None if obj.get("layer_recompute_s") is None else float(obj["layer_recompute_s"]),
            created_at=float(obj.get("created_at", 0.0)), meta=dict(obj.get("meta", {})),
        )

    def with_codec_update(self, updates: dict[str, dict[str, CodecProfile]]) -> LayerProfile:
        """A copy with some ops' codec profiles replaced (adaptive evolution re-measures these)."""
        new = copy.deepcopy(self)
        for op_name, codecs in updates.items():
            new.op(op_name).codecs.update(copy.deepcopy(codecs))
        return new


# ---------------------------------------------------------------------------------- analytic profile
def op_output_elements(sig: dict[str, Any]) -> dict[str, int]:
    """Elements of each op's output for one layer and micro-batch (megatron-core GPT layer, no TP)."""
    s, b, h = sig["seq_length"], sig["micro_batch_size"], sig["hidden_size"]
    a, f = sig["num_attention_heads"], sig["ffn_hidden_size"]
    tok = s * b
    attn = b * a * s * s
    return {
        "layer_input": tok * h, "input_layernorm": tok * h, "linear_qkv": 3 * tok * h, "scores": attn, "softmax": attn,
        "dropout": attn, "context": tok * h, "linear_proj": tok * h, "self_attn_bda": tok * h,
        "pre_mlp_layernorm": tok * h, "linear_fc1": tok * f, "activation": tok * f, "linear_fc2": tok * h,
        "mlp_bda": tok * h,
    }


def mlp_weight_bytes(sig: dict[str, Any]) -> int:
    """Bytes of one layer's MLP weights on one tensor-parallel rank (``linear_fc1``'s, twice as wide for a gated
    unit, and ``linear_fc2``'s; biases are left out), in the model's dtype: the size of their gradients."""
    e = {"float32": 4, "float16": 2, "bfloat16": 2}.get(sig.get("dtype", "float32"), 4)
    h, f = sig["hidden_size"], sig["ffn_hidden_size"]
    fc1 = h * f * (2 if sig.get("gated_linear_unit") else 1)
    return e * (fc1 + f * h) // max(int(sig.get("tensor_model_parallel_size") or 1), 1)


def analytic_profile(sig: dict[str, Any], *, device: str = "analytic", flops_per_s: float = 5e10,
                     bytes_per_s: float = 5e9, codec_bytes_per_s: float = 2e9, outlier_fraction: float = 0.01,
                     group_size: int = 128, static_bytes: int | None = None) -> LayerProfile:
    """A profile from shape formulas (no measurement): for tests, docs and a first guess before profiling.

    Matmul ops cost ``2mnk / flops_per_s``; element-wise ops ``bytes / bytes_per_s``; codecs touch the
    tensor once at ``codec_bytes_per_s``. INT4 codecs store 4 bits per value plus one fp32 scale (and an
    offset for asymmetric) per ``group_size`` values; outlier-separated INT4 also stores ``outlier_fraction``
    of the channels unquantized.

    The sizes are not the codecs' own ``compressed_nbytes``: those agree for the grouped codecs on tensors a
    whole number of groups long (a test pins it), but the channel-wise and outlier codecs' formulas follow the
    tensor's layout (a scale per channel or per row), which this shape-free model does not have. Switching
    would change every profile made here and the policies solved from them.
    """
    e = {"float32": 4, "float16": 2, "bfloat16": 2}.get(sig["dtype"], 4)
    s, b, h = sig["seq_length"], sig["micro_batch_size"], sig["hidden_size"]
    f = sig["ffn_hidden_size"]
    tok = s * b
    n = op_output_elements(sig)
    matmul_flops = {
        "linear_qkv": 2 * tok * h * 3 * h, "scores": 2 * b * s * s * h, "context": 2 * b * s * s * h,
        "linear_proj": 2 * tok * h * h, "linear_fc1": 2 * tok * h * f, "linear_fc2": 2 * tok * f * h,
    }
    ops = []
    for spec in OPS:
        elems = n[spec.name]
        nbytes = elems * e
        if spec.name in matmul_flops:
            t = matmul_flops[spec.name] / flops_per_s
        else:
            t = 2 * nbytes / bytes_per_s
        codecs = {}
        for codec in spec.codecs:
            if codec == "bitmask":
                cb = (elems + 7) // 8
            elif codec == "stochastic":
                cb = elems // 2 + 8 * (elems // group_size)
            elif codec == "int4_asymmetric":
                cb = elems // 2 + 8 * (elems // group_size)
            elif codec == "int4_outlier":
                cb = int(elems // 2 + 4 * (elems // group_size) + outlier_fraction * nbytes)
            else:
                cb = elems // 2 + 4 * (elems // group_size)
            codecs[codec] = CodecProfile(cb, nbytes / codec_bytes_per_s, nbytes / codec_bytes_per_s,
                                         {"outlier_fraction": outlier_fraction} if codec == "int4_outlier" else {})
        ops.append(OpProfile(spec.name, nbytes, t, codecs))
    if static_bytes is None:
        params = sig["num_layers"] * (4 * h * h + 2 * h * f + 9 * h + f)
        static_bytes = 16 * params  # fp32 params + grads + Adam m, v
    vocab = int(sig.get("vocab_size", 0) or 0)
    return LayerProfile(device=device, signature=dict(sig), ops=ops, static_bytes=static_bytes,
                        workspace_bytes=2 * 4 * vocab * tok, source="analytic")
