"""The ops of one megatron-core ``TransformerLayer``, in forward order: the unit Adacc decides on.

This is the single definition shared by the policy maker (profiler, MILP, policy files) and the runtime
that executes policies. A decision on an op applies to the op's OUTPUT activation, i.e. what later ops save
for backward. The first op's output is the layer's checkpoint: it is kept or compressed, never recomputed
(eq. 6 of the Adacc paper).
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIONS: tuple[str, ...] = ("keep", "compress", "recompute")
"""The three per-op actions of the paper: retention (R_{i,2}), compression (R_{i,1}), recomputation (R_{i,0})."""

CODECS: tuple[str, ...] = (
    "int4_outlier",
    "int4_channelwise",
    "int4_asymmetric",
    "int4_symmetric",
    "bitmask",
    "stochastic",
)
"""Codec names known to the policy files (implemented in ``megatron_adacc.codecs``)."""


@dataclass(frozen=True)
class OpSpec:
    """One op of the transformer layer."""

    name: str
    default_codec: str
    """The layer-specific codec of the paper (section 3.2) for this op's output."""
    codecs: tuple[str, ...]
    """Every codec the runtime accepts for this op's output; the default codec comes first."""
    recomputable: bool = True
    """False only for the layer's first op, whose output is the checkpoint (eq. 6)."""
    uses_rng: bool = False
    """Draws from a random generator (dropout): recomputing it needs a saved copy of the RNG states."""


# Plain INT4 (the paper's "Quantization" baseline) and GACT's stochastic quantizer apply everywhere;
# the layer-specific codec of section 3.2 is listed first for each op.
_GENERIC = ("int4_symmetric", "stochastic")


def _spec(name: str, default: str, *extra: str, recomputable: bool = True, uses_rng: bool = False) -> OpSpec:
    codecs = (default,) + tuple(c for c in extra + _GENERIC if c != default)
    return OpSpec(name=name, default_codec=default, codecs=codecs, recomputable=recomputable, uses_rng=uses_rng)


OPS: tuple[OpSpec, ...] = (
    _spec("input_layernorm", "int4_outlier", recomputable=False),
    _spec("linear_qkv", "int4_channelwise"),
    _spec("scores", "int4_asymmetric"),
    _spec("softmax", "int4_asymmetric"),
    # The runtime compresses an op's float tensors with the decision's codec and keeps non-float ones, so
    # the dropout op's float output (saved by the context matmul) takes one-sided INT4; "bitmask" only
    # packs bool/0-1 masks and is listed for a runtime that routes the mask to it.
    _spec("dropout", "int4_asymmetric", "bitmask", uses_rng=True),
    _spec("context", "int4_outlier"),
    _spec("linear_proj", "int4_outlier"),
    _spec("self_attn_bda", "int4_outlier", uses_rng=True),
    _spec("pre_mlp_layernorm", "int4_outlier"),
    _spec("linear_fc1", "int4_outlier"),
    _spec("activation", "int4_outlier"),
    _spec("linear_fc2", "int4_outlier"),
    _spec("mlp_bda", "int4_outlier", uses_rng=True),
)

OP_NAMES: tuple[str, ...] = tuple(op.name for op in OPS)
OPS_BY_NAME: dict[str, OpSpec] = {op.name: op for op in OPS}

OUTLIER_CODEC = "int4_outlier"
"""The outlier-separated codec whose compression ratio drifts during training (section 3.4)."""


def op_spec(name: str) -> OpSpec:
    """The spec of op ``name``; raises a ``KeyError`` listing the valid names otherwise."""
    try:
        return OPS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; the ops of a transformer layer are {', '.join(OP_NAMES)}") from None
