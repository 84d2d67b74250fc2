"""Policy objects: one decision (keep, compress with a codec, recompute) per op of every transformer layer."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_adacc.adacc.policy.ops import ACTIONS, CODECS, MAX_TILES, OP_NAMES, OPS, OPS_BY_NAME, TILED_OPS, Action

DEFAULT_CODEC_PARAMS: dict[str, dict[str, Any]] = {
    # Z-score threshold of eq. 1; 3 is the paper's setting.
    "int4_outlier": {"z_threshold": 3.0},
}
"""Parameters written into policy files when a caller names a codec without parameters."""


@dataclass(frozen=True)
class Decision:
    """What happens to one op's output activation."""

    action: Action
    """An :class:`Action`; its value (``"keep"``) is accepted too and turned into the member."""
    codec: str | None = None
    codec_params: Mapping[str, Any] = field(default_factory=dict)
    tiles: int = 1
    """For recompute on the MLP's token-wise ops (:data:`~.ops.TILED_OPS`, all three alike): re-run them in this
    many token tiles, each tile's forward and backward before the next's, inside the block's own backward
    (:mod:`megatron_adacc.adacc.runtime.tiled`). 1: the ops join the layer's recompute segments like any other."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; expected one of {', '.join(ACTIONS)}")
        # frozen: the normalization has to go around the dataclass's __setattr__
        object.__setattr__(self, "action", Action(self.action))
        if isinstance(self.tiles, bool) or not isinstance(self.tiles, int) or not 1 <= self.tiles <= MAX_TILES:
            raise ValueError(f"tiles must be a whole number from 1 to {MAX_TILES}, got {self.tiles!r}")
        if self.tiles > 1 and self.action != Action.RECOMPUTE:
            raise ValueError(f"tiles={self.tiles} needs action recompute (got {self.action.value!r})")
        # whether the op joins the layer's recompute segments (held_action): read in the inner loops of the Pareto
        # DP and the MILP graph (cost_model.Choice.is_recompute), so set once
        object.__setattr__(self, "in_segment", held_action(self) == Action.RECOMPUTE)
        if self.action == Action.COMPRESS:
            if self.codec not in CODECS:
                raise ValueError(f"compress needs a codec, one of {', '.join(CODECS)}; got {self.codec!r}")
        elif self.codec is not None:
            raise ValueError(f"action {self.action.value!r} takes no codec (got {self.codec!r})")

    @staticmethod
    def keep() -> Decision:
        return Decision(Action.KEEP)

    @staticmethod
    def recompute(tiles: int = 1) -> Decision:
        return Decision(Action.RECOMPUTE, tiles=tiles)

    @staticmethod
    def compress(codec: str, **params: Any) -> Decision:
        merged = dict(DEFAULT_CODEC_PARAMS.get(codec, {}))
        merged.update(params)
        return Decision(Action.COMPRESS, codec, merged)

    @property
    def label(self) -> str:
        """Short human label: ``keep``, ``recompute``, ``recompute:tiles=<n>`` or ``compress:<codec>``."""
        if self.action == Action.COMPRESS:
            return f"compress:{self.codec}"
        return f"recompute:tiles={self.tiles}" if self.tiles > 1 else self.action.value

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"action": self.action.value}
        if self.action == Action.COMPRESS:
            out["codec"] = self.codec
            out["codec_params"] = dict(self.codec_params)
        if self.tiles > 1:
            out["tiles"] = self.tiles
        return out

    def __hash__(self) -> int:  # codec_params is a dict; hash its sorted items
        return hash((self.action, self.codec, tuple(sorted(self.codec_params.items())), self.tiles))


def parse_decision(value: str | Decision, op: str) -> Decision:
    """Turn ``keep`` / ``recompute`` / ``recompute:tiles=<n>`` / ``compress`` (the op's default codec) / a codec
    name into a Decision."""
    if isinstance(value, Decision):
        return value
    spec = OPS_BY_NAME[op]
    if value in (Action.KEEP, Action.RECOMPUTE):
        return Decision(value)
    if value.startswith("recompute:tiles="):
        count = value.split("=", 1)[1]
        if not count.isdigit():
            raise ValueError(f"cannot read {value!r} as a decision for op {op!r}: tiles must be a whole number")
        return Decision.recompute(int(count))
    if value == Action.COMPRESS:
        return Decision.compress(spec.default_codec)
    if value.startswith("compress:"):
        value = value.split(":", 1)[1]
    if value in CODECS:
        if value not in spec.codecs:
            raise ValueError(f"codec {value!r} does not apply to op {op!r}; it accepts {', '.join(spec.codecs)}")
        return Decision.compress(value)
    raise ValueError(f"cannot read {value!r} as a decision for op {op!r}: use keep, recompute, "
                     f"recompute:tiles=<n>, compress, or a codec name ({', '.join(CODECS)})")


@dataclass
class Policy:
    """Per-layer, per-op decisions plus the metadata stored in a policy file.

    ``layers[l][i]`` is the decision on the output of ``OPS[i]`` in transformer layer ``l`` (0-based,
    counted within this pipeline stage).
    """

    layers: list[list[Decision]]
    signature: dict[str, Any] | None = None
    """The model signature the policy was made for (see :func:`model_signature`); None = any model."""
    budget_bytes: int | None = None
    predicted: dict[str, Any] = field(default_factory=dict)
    """``memory_bytes``, ``static_bytes``, ``activation_bytes``, ``time_s`` (per-iteration overhead) ..."""
    solver: dict[str, Any] = field(default_factory=dict)
    """``strategy``, ``status``, ``solve_time_s``, switches used."""
    profile: dict[str, Any] | None = None
    """Reference to the profile the policy was solved from (database path, profile id, device)."""
    name: str | None = None
    op_costs: dict[str, dict[str, Any]] | None = None
    """Per op, what its choices cost under the profile the policy was solved from: ``saved_bytes`` (kept),
    ``recompute_time_s``, and ``codecs: {name: {"compressed_bytes", "time_s"}}`` for the codecs the policy uses.
    Kept in the file, so that ``adacc show`` prints sizes on a machine without that profile."""

    def __post_init__(self) -> None:
        for index, layer in enumerate(self.layers):
            if len(layer) != len(OPS):
                raise ValueError(f"layer {index} has {len(layer)} decisions; expected {len(OPS)} "
                                 f"({', '.join(OP_NAMES)})")
            for op, d in zip(OPS, layer):
                if d.action == Action.RECOMPUTE and not op.recomputable:
                    raise ValueError(f"layer {index}: op {op.name!r} is the layer's checkpoint and cannot be "
                                     "recomputed")
                if d.action == Action.COMPRESS and d.codec not in op.codecs:
                    raise ValueError(f"layer {index}: codec {d.codec!r} does not apply to op {op.name!r}; "
                                     f"it accepts {', '.join(op.codecs)}")
                if d.tiles > 1 and not op.tileable:
                    raise ValueError(f"layer {index}: op {op.name!r} cannot be re-run in tiles; only the MLP's "
                                     f"{', '.join(TILED_OPS)} can")
            check_tiles(dict(zip(OP_NAMES, layer)), f"layer {index}: ")

    # ----------------------------------------------------------------------------------------- access
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def solved(self) -> bool:
        """Whether the policy names the profile and budget it was solved against (``auto``'s, or a file written
        by ``adacc solve``): what policy evolution re-solves from. Presets and hand-written files do not."""
        return self.profile is not None and self.budget_bytes is not None

    def counts(self) -> dict[Action, int]:
        """How many saved tensors each action covers, over every layer."""
        found = {action: 0 for action in Action}
        for layer in self.layers:
            for d in layer:
                found[d.action] += 1
        return found

    def summary(self) -> str:
        """``18 keep, 4 compress, 4 recompute`` (actions that occur)."""
        return ", ".join(f"{n} {action.value}" for action, n in self.counts().items() if n)

    def decision_cost(self, op: str, decision: Decision) -> tuple[int, int, float] | None:
        """``(saved bytes if kept, stored bytes, time)`` of ``decision`` on ``op`` from :attr:`op_costs` (time: the
        recompute, or the compress and decompress, per micro-batch and layer); None when the file does not say."""
        cost = (self.op_costs or {}).get(op)
        if cost is None:
            return None
        saved = int(cost["saved_bytes"])
        if decision.action == Action.KEEP:
            return saved, saved, 0.0
        if decision.action == Action.RECOMPUTE:
            return saved, 0, float(cost["recompute_time_s"])
        codec = cost.get("codecs", {}).get(decision.codec)
        return None if codec is None else (saved, int(codec["compressed_bytes"]), float(codec["time_s"]))

    def decision(self, layer: int, op: str) -> Decision:
        return self.layers[layer][OP_NAMES.index(op)]

    def layer_decisions(self, layer: int) -> dict[str, Decision]:
        return dict(zip(OP_NAMES, self.layers[layer]))

    def same_decisions(self, other: Policy) -> bool:
        return self.layers == other.layers

    def copy(self) -> Policy:
        return copy.deepcopy(self)

    def stage(self, first: int, count: int) -> Policy:
        """The decisions of layers ``first .. first + count - 1``: what one pipeline stage of the model this
        policy was made for installs. A policy joined from its stages' (:meth:`join`) gives that stage its own
        prediction; a whole-model prediction does not carry over to a stage."""
        if first < 0 or count < 1 or first + count > self.num_layers:
            raise ValueError(f"layers {first}..{first + count - 1} are not within this policy's "
                             f"{self.num_layers} layers")
        part = copy.deepcopy(self)
        stages = {(s["first_layer"], s["num_layers"]): s for s in self.predicted.get("stages") or ()}
        own = stages.get((first, count))
        part.layers = part.layers[first:first + count]
        part.predicted = {} if own is None else {
            **{k: v for k, v in own.items() if k not in ("first_layer", "num_layers")},
            "per_layer": copy.deepcopy(self.predicted.get("per_layer", [])[first:first + count])}
        return part

    @classmethod
    def join(cls, stages: Sequence[Policy], **meta: Any) -> Policy:
        """One policy for a whole pipeline from its stages' policies, first stage first: their layers in order
        (global layer numbers) and each stage's prediction in ``predicted["stages"]``, which :meth:`stage` gives
        back to the stage that installs its slice; ``per_layer`` spans every layer."""
        layers, per_layer, predicted = [], [], []
        for part in stages:
            own = {k: v for k, v in part.predicted.items() if k != "per_layer"}
            predicted.append({"first_layer": len(layers), "num_layers": part.num_layers, **own})
            per_layer += part.predicted.get("per_layer", [])
            layers += copy.deepcopy(part.layers)
        joined = {"stages": predicted, **({"per_layer": per_layer} if len(per_layer) == len(layers) else {})}
        peaks = [s["memory_bytes"] for s in predicted if "memory_bytes" in s]
        if len(peaks) == len(predicted):
            joined["memory_bytes"] = max(peaks)  # the stage that needs the most
        return cls(layers=layers, predicted=joined, **meta)

    # ---------------------------------------------------------------------------------- construction
    @classmethod
    def uniform(cls, spec: str | Decision | Mapping[str, str | Decision] | Sequence[str | Decision],
                num_layers: int, **meta: Any) -> Policy:
        """The same decisions in every layer.

        ``spec`` is one action or codec for every op (``"keep"``, ``"recompute"``, ``"compress"`` for
        each op's default codec, or a codec name), a map ``{op: action-or-codec}`` (missing ops are kept),
        or a sequence with one entry per op. With a single ``"recompute"``, the first op stays kept,
        because it is the layer's checkpoint.
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if isinstance(spec, (str, Decision)):
            layer = []
            for op in OPS:
                if not op.recomputable and (spec == Action.RECOMPUTE or
                                            (isinstance(spec, Decision) and spec.action == Action.RECOMPUTE)):
                    layer.append(Decision.keep())
                else:
                    layer.append(parse_decision(spec, op.name))
        elif isinstance(spec, Mapping):
            unknown = set(spec) - set(OP_NAMES)
            if unknown:
                raise ValueError(f"unknown op(s) {sorted(unknown)}; the ops are {', '.join(OP_NAMES)}")
            layer = [parse_decision(spec.get(op, Action.KEEP), op) for op in OP_NAMES]
        else:
            if len(spec) != len(OPS):
                raise ValueError(f"need one decision per op ({len(OPS)}), got {len(spec)}")
            layer = [parse_decision(v, op) for v, op in zip(spec, OP_NAMES)]
        return cls(layers=[list(layer) for _ in range(num_layers)], **meta)

    @classmethod
    def all_keep(cls, num_layers: int) -> Policy:
        return cls.uniform(Action.KEEP, num_layers, name="keep")

    @classmethod
    def all_recompute(cls, num_layers: int) -> Policy:
        """Megatron's full recompute: the layer input kept in full and every op recomputed from it, so the same
        bytes are held and training is bit-identical."""
        return cls.uniform(Action.RECOMPUTE, num_layers, name="recompute")

    @classmethod
    def quantize_all(cls, num_layers: int) -> Policy:
        """The paper's Quantization baseline: every activation plain INT4 (per-group symmetric)."""
        return cls.uniform("int4_symmetric", num_layers, name="quantize-all")

    @classmethod
    def preset(cls, name: str, num_layers: int) -> Policy:
        """A named preset (:data:`PRESET_NAMES`, or a spelling :func:`preset_key` accepts)."""
        key = preset_key(name)
        if key is None:
            raise ValueError(f"unknown policy preset {name!r}; presets are {', '.join(PRESET_NAMES)}")
        return {"keep": cls.all_keep, "recompute": cls.all_recompute, "quantize-all": cls.quantize_all}[key](num_layers)


def held_action(decision: Decision) -> Action:
    """How the runtime holds the op's tensors: the decision's action, but keep for a recompute in token tiles,
    whose block re-runs inside its own backward (:mod:`megatron_adacc.adacc.runtime.tiled`), so that it joins no
    recompute segment and an output of it a later segment stores is held as it is. (A duck-typed decision without
    ``tiles`` is untiled.)"""
    return Action.KEEP if getattr(decision, "tiles", 1) > 1 else decision.action


def check_tiles(decisions: Mapping[str, Decision], where: str = "") -> int:
    """The token tiles a layer's ``decisions`` re-run its MLP in (1: none); raises a ``ValueError`` unless the
    MLP's token-wise ops are all recomputed in the same number of tiles, or none of them is tiled."""
    tiles = {getattr(decisions[name], "tiles", 1) for name in TILED_OPS}
    if len(tiles) > 1 or (max(tiles) > 1 and any(decisions[name].action != Action.RECOMPUTE for name in TILED_OPS)):
        shown = ", ".join(f"{name} {decisions[name].label}" for name in TILED_OPS)
        raise ValueError(f"{where}a tiled MLP re-run needs {', '.join(TILED_OPS)} all recomputed in the same "
                         f"number of tiles (got {shown})")
    return tiles.pop()


PRESET_NAMES: tuple[str, ...] = ("keep", "recompute", "quantize-all")
"""The presets ``--adacc-policy`` accepts besides ``none``, ``auto`` and a file."""
_PRESET_ALIASES = {"all-keep": "keep", "all-recompute": "recompute"}


def preset_key(name: str) -> str | None:
    """The preset ``name`` means (underscores, upper case and the ``all-`` spellings accepted), or None."""
    key = str(name).replace("_", "-").lower()
    key = _PRESET_ALIASES.get(key, key)
    return key if key in PRESET_NAMES else None
