"""The ops of one megatron-core ``TransformerLayer``, in forward order: the unit Adacc decides on.

This is the single definition shared by the policy maker (profiler, MILP, policy files) and the runtime
that executes policies. A decision on an op applies to the op's OUTPUT activation, i.e. what later ops save
for backward. The first op's output is the layer's checkpoint: it is kept or compressed, never recomputed
(eq. 6 of the Adacc paper).

That first op is ``layer_input``, the layer's input itself (the residual stream), where the paper's eq. 6
keeps ``input_layernorm``'s output and holds the layer input in full beside it. Moving the checkpoint one op up
lets the cheapest policy store the input compressed (outlier-separated INT4, as the residual stream's outlier
channels call for) and recompute ``input_layernorm`` with the rest, below Megatron's full recompute, which holds
the input in full; keeping the input and recomputing every other op is exactly that full recompute (the
``recompute`` preset). Eq. 6's policies are all still there: ``layer_input`` kept and ``input_layernorm`` not
recomputed.

It also names what can happen to an op's output (:class:`Action`) and defines, once for the runtime, the
memory predictor, the cost model and the MILPs, which ops backward re-runs together (:func:`segments`).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from megatron_adacc.codecs.keep import KeepCodec
from megatron_adacc.codecs.registry import CODECS as _CODEC_CLASSES
from megatron_adacc.models import SDPA, UNFUSED


class Action(str, enum.Enum):
    """The three per-op actions of the paper: retention (R_{i,2}), compression (R_{i,1}), recomputation (R_{i,0}).

    A ``str`` enum: a member equals, hashes and formats as its value, so policy files, profile keys and
    callers that still pass ``"keep"`` work unchanged. (Not ``enum.StrEnum``, which Python 3.10 lacks.)
    """

    KEEP = "keep"
    COMPRESS = "compress"
    RECOMPUTE = "recompute"

    # Enum installs its own __str__ ("Action.KEEP") and __format__ (which follows it from Python 3.12) on
    # every subclass; take str's, as enum.StrEnum does, so a member prints, formats and hashes as its value
    # (the hash already comes from str through the MRO: stated so dict lookups by value can rely on it).
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


ACTIONS: tuple[Action, ...] = tuple(Action)
"""Every action, in the order policy files and messages list them."""


@dataclass(frozen=True)
class OpSpec:
    """One op of the transformer layer."""

    name: str
    default_codec: str
    """The layer-specific codec of the paper (section 3.2) for this op's output."""
    codecs: tuple[str, ...]
    """Every codec the runtime accepts for this op's output; the default codec comes first."""
    recomputable: bool = True
    """False only for the layer's first op, the layer input, which is the checkpoint (eq. 6)."""
    uses_rng: bool = False
    """Draws from a random generator (dropout): recomputing it needs a saved copy of the RNG states."""
    changed_by_reader: bool = False
    """The op that reads this output changes it in place (softmax masks the scores): a recompute segment that
    starts after it re-runs on a copy, so the stored value stays intact."""
    tileable: bool = False
    """One of the MLP's token-wise ops (``linear_fc1``, ``activation``, ``linear_fc2``), which a recompute decision
    may re-run together in token tiles (:attr:`~megatron_adacc.adacc.policy.policy.Decision.tiles`)."""
    reads: tuple[str, ...] = ()
    """Earlier ops, besides the one right before it, whose outputs this op reads in forward (the attention reads
    Q, K and V past the score ops, a residual add reads the residual stream). A recompute segment holding this op
    re-runs from those outputs too: when one was recomputed in another segment, that segment re-runs with it
    (:func:`split_reads`). The runtime's op tables are checked against these."""


# Plain INT4 (the paper's "Quantization" baseline) and GACT's stochastic quantizer apply everywhere;
# the layer-specific codec of section 3.2 is listed first for each op.
_GENERIC = ("int4_symmetric", "stochastic")


def _spec(name: str, default: str, *extra: str, recomputable: bool = True, uses_rng: bool = False,
          changed_by_reader: bool = False, tileable: bool = False, reads: tuple[str, ...] = ()) -> OpSpec:
    codecs = (default,) + tuple(c for c in extra + _GENERIC if c != default)
    return OpSpec(name=name, default_codec=default, codecs=codecs, recomputable=recomputable, uses_rng=uses_rng,
                  changed_by_reader=changed_by_reader, tileable=tileable, reads=reads)


OPS: tuple[OpSpec, ...] = (
    _spec("layer_input", "int4_outlier", recomputable=False),
    _spec("input_layernorm", "int4_outlier"),
    _spec("linear_qkv", "int4_smoothed", "int4_channelwise"),
    _spec("scores", "int4_asymmetric", changed_by_reader=True),
    _spec("softmax", "int4_asymmetric"),
    # The runtime compresses an op's float tensors with the decision's codec and keeps non-float ones, so
    # the dropout op's float output (saved by the context matmul) takes one-sided INT4; "bitmask" only
    # packs bool/0-1 masks and is listed for a runtime that routes the mask to it.
    _spec("dropout", "int4_asymmetric", "bitmask", uses_rng=True),
    _spec("context", "int4_outlier", reads=("linear_qkv",)),
    _spec("linear_proj", "int4_outlier"),
    _spec("self_attn_bda", "int4_outlier", uses_rng=True, reads=("layer_input",)),
    _spec("pre_mlp_layernorm", "int4_outlier"),
    _spec("linear_fc1", "int4_outlier", tileable=True),
    _spec("activation", "int4_outlier", tileable=True),
    _spec("linear_fc2", "int4_outlier", tileable=True),
    _spec("mlp_bda", "int4_outlier", uses_rng=True, reads=("self_attn_bda",)),
)

OP_NAMES: tuple[str, ...] = tuple(op.name for op in OPS)
OPS_BY_NAME: dict[str, OpSpec] = {op.name: op for op in OPS}

CODECS: tuple[str, ...] = tuple(dict.fromkeys(
    [op.default_codec for op in OPS] + [name for name in _CODEC_CLASSES if name != KeepCodec.name]))
"""Codecs a compress decision may name: the codec registry's (:mod:`megatron_adacc.codecs.registry` owns
the names) but ``keep``, which is the keep action rather than a compression. Listed as policy files' schema
and messages list them: the ops' layer-specific codecs first, then the others in registry order."""

assert {c for op in OPS for c in op.codecs} <= set(CODECS), "an op names a codec the codec registry lacks"

TILED_OPS: tuple[str, ...] = tuple(op.name for op in OPS if op.tileable)
"""The MLP's token-wise ops, which a tiled recompute re-runs as one block
(:mod:`megatron_adacc.adacc.runtime.tiled`)."""
MAX_TILES = 64
"""The most token tiles a tiled recompute cuts the MLP's re-run into: past a few, the tiles' re-materialized
bytes are smaller than the gradients of the block's input and output, which are held at full size anyway."""

OUTLIER_CODEC = "int4_outlier"
"""The outlier-separated codec whose compression ratio drifts during training (section 3.4)."""

#: ``--adacc-codec``: what the tensors a solved policy compresses use; ``none`` compresses nothing (each tensor
#: is kept or recomputed, so training is bit-identical to stock Megatron).
CODEC_FAMILIES = ("int4", "gact", "none")

RNG_OPS: dict[str, frozenset[str]] = {
    UNFUSED: frozenset(op.name for op in OPS if op.uses_rng),
    SDPA: frozenset(op.name for op in OPS if op.uses_rng) - {"dropout"} | {"context"},
}
"""Per core attention (:mod:`megatron_adacc.models`' kinds), the ops that draw random numbers when dropout is on,
whose recompute segments hold a copy of the RNG states: the fused SDPA kernel draws attention dropout inside
``context``, where the unfused attention has its ``dropout`` op (``uses_rng`` says the unfused layer's)."""


def op_spec(name: str) -> OpSpec:
    """The spec of op ``name``; raises a ``KeyError`` listing the valid names otherwise."""
    try:
        return OPS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; the ops of a transformer layer are {', '.join(OP_NAMES)}") from None


# ------------------------------------------------------------------------------------- recompute segments
def segments(recomputed: Iterable[bool]) -> list[range]:
    """The recompute segments of one layer: its maximal runs of consecutive recomputed ops, as ranges of op
    indices in forward order.

    ``recomputed`` has one flag per op, in forward order (e.g. ``d.action == Action.RECOMPUTE`` for each
    decision of the layer). Backward re-runs each segment as a whole from its stored inputs: the values its
    ops read that no op of the segment produces (:func:`megatron_adacc.adacc.runtime.ops.segment_inputs`), of
    which the output of op ``seg.start - 1``, stored (kept or compressed) by maximality, is one; a segment
    that starts at op 0 reads the layer's input instead (a layer never recomputes op 0, its checkpoint).

    Only the flags count: a kept op that saves no tensor still separates two segments, and a recomputed op
    that saves none still belongs to its run (whether such a segment holds anything after forward is the
    memory model's question, not this one's). No recomputed op gives ``[]``.
    """
    found: list[range] = []
    start = 0
    for flag, run in itertools.groupby(bool(f) for f in recomputed):
        stop = start + sum(1 for _ in run)
        if flag:
            found.append(range(start, stop))
        start = stop
    return found


def cross_reads(op_names: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """``(producer, reader)`` index pairs of ``op_names`` where the reader reads the producer's output past the
    ops between them (:attr:`OpSpec.reads`); names that are not the layer's ops read nothing."""
    index = {name: i for i, name in enumerate(op_names)}
    return tuple((index[p], i) for i, name in enumerate(op_names) if name in OPS_BY_NAME
                 for p in OPS_BY_NAME[name].reads if p in index)


def split_reads(recomputed: Sequence[bool], reads: Iterable[tuple[int, int]]) -> bool:
    """Whether a recompute segment of the layer reads an output that another segment recomputes: a producer and its
    reader of ``reads`` both recomputed, with a stored op between them.

    The runtime re-runs such a reader's segment from the producer's output, which is a token into the producer's
    segment, so that segment re-runs in full at the reader's re-run, earlier in backward than its own readers ask
    for, and holds its values from there. The cost model places them so (:meth:`~.cost_model.Problem.stage_bytes`);
    the solvers leave these policies out (a segment's stages would then depend on later ones). Little is lost: the
    two segments re-run together anyway, so recomputing the ops between them too holds the same values at the
    same stages, and only trades those ops' stored bytes for their recompute time (under SDPA the ops between
    the projection and the attention are empty: nothing at all)."""
    return any(recomputed[p] and recomputed[r] and not all(recomputed[p:r + 1]) for p, r in reads)


def candidate_segments(recomputable: Sequence[bool], start: int) -> Iterator[range]:
    """Every recompute segment a layer policy can have after storing op ``start - 1``, for the enumerations
    of policies (the Pareto DP, the chain-aware MILP's graph): ``range(start, stop)`` for ``stop`` from
    ``start`` (the empty segment: op ``start`` is stored too) up to the first op at or after ``start`` that
    cannot be recomputed (``recomputable[i]`` is False: it must be stored), or to the number of ops (the
    segment runs to the layer's end).

    Op ``stop`` is the next stored op, so each candidate is maximal: it is the one of :func:`segments` that
    starts at ``start`` in a layer storing ops ``start - 1`` and ``stop``.
    """
    n = len(recomputable)
    for stop in range(start, n + 1):
        yield range(start, stop)
        if stop < n and not recomputable[stop]:
            return
