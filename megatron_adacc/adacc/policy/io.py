"""Policy files: versioned JSON, validated on load with errors that name the offending field.

The published schema is ``policy.schema.json`` beside this module (JSON Schema draft 2020-12) and is
described in ``docs/policy-schema.md``. Validation here is hand-written so that the package needs no
``jsonschema`` dependency and every error names the field path (``layers[3].decisions[2].codec``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from megatron_adacc.adacc.policy.ops import ACTIONS, CODECS, MAX_TILES, OP_NAMES, OPS_BY_NAME, TILED_OPS, Action
from megatron_adacc.adacc.policy.policy import Decision, Policy, check_tiles
from megatron_adacc.adacc.policy.signature import NULLABLE_FIELDS, SIGNATURE_FIELDS, SIGNATURE_TYPES, check_signature
from megatron_adacc.codecs import get_codec
from megatron_adacc.core.errors import AdaccError, InputNotFound
from megatron_adacc.core.files import atomic_write

FORMAT = "megatron-adacc-policy"
SCHEMA_VERSION = 3
#: Older versions this one reads, with the ops their files decide on. Version 2 had no ``layer_input`` op: the
#: layer input was always kept in full, which is what reading its decisions with ``layer_input`` kept runs.
READABLE: dict[int, tuple[str, ...]] = {SCHEMA_VERSION: OP_NAMES, 2: OP_NAMES[1:]}
SCHEMA_PATH = Path(__file__).with_name("policy.schema.json")


class PolicySchemaError(AdaccError, ValueError):
    """A policy file does not follow the schema; ``field`` is the path of the offending field."""

    def __init__(self, field: str, problem: str, source: str | None = None):
        self.field = field
        where = f"{source}: " if source else ""
        super().__init__(f"{where}invalid policy file: field '{field}' {problem}")


# ------------------------------------------------------------------------------------------ writing
def policy_to_json(policy: Policy) -> dict[str, Any]:
    """The JSON object of a policy (schema version :data:`SCHEMA_VERSION`)."""
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "name": policy.name,
        "model_signature": dict(policy.signature) if policy.signature is not None else None,
        "budget_bytes": policy.budget_bytes,
        "ops": list(OP_NAMES),
        "layers": [
            {"decisions": [{"op": op, **d.to_json()} for op, d in zip(OP_NAMES, layer)]}
            for layer in policy.layers
        ],
        "predicted": dict(policy.predicted),
        "solver": dict(policy.solver),
        "profile": dict(policy.profile) if policy.profile is not None else None,
        **({"op_costs": policy.op_costs} if policy.op_costs is not None else {}),
    }


def save_policy(policy: Policy, path: str | os.PathLike) -> Path:
    """Write ``policy`` to ``path`` (parent folders created); returns the path."""
    text = json.dumps(policy_to_json(policy), indent=1) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode()))


# ------------------------------------------------------------------------------------------ reading
def _require(obj: dict, key: str, path: str, types: type | tuple[type, ...], *, nullable: bool = False) -> Any:
    if key not in obj:
        raise PolicySchemaError(f"{path}{key}", "is missing")
    value = obj[key]
    if value is None and nullable:
        return None
    # bool is an int in Python; a JSON true is never a valid count
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise PolicySchemaError(f"{path}{key}", f"must be {_type_name(types)}, got a boolean")
    if not isinstance(value, types):
        raise PolicySchemaError(f"{path}{key}", f"must be {_type_name(types)}{' or null' if nullable else ''}, "
                                f"got {type(value).__name__} {value!r}"[:200])
    return value


def _type_name(types: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
             bool: "a boolean"}
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in ts)


def _decision_from_json(obj: Any, path: str, op: str, op_names: tuple[str, ...]) -> Decision:
    if not isinstance(obj, dict):
        raise PolicySchemaError(path, f"must be an object, got {type(obj).__name__}")
    name = _require(obj, "op", path + ".", str)
    if name != op:
        raise PolicySchemaError(f"{path}.op", f"is {name!r} but position says {op!r} (ops must follow "
                                f"the forward order {', '.join(op_names)})")
    action = _require(obj, "action", path + ".", str)
    if action not in ACTIONS:
        raise PolicySchemaError(f"{path}.action", f"is {action!r}; expected one of {', '.join(ACTIONS)}")
    spec = OPS_BY_NAME[op]
    if action == Action.RECOMPUTE and not spec.recomputable:
        raise PolicySchemaError(f"{path}.action", f"op {op!r} is the layer's checkpoint and cannot be "
                                "recomputed (eq. 6); use keep or compress")
    tiles = obj.get("tiles", 1)
    if isinstance(tiles, bool) or not isinstance(tiles, int) or not 1 <= tiles <= MAX_TILES:
        raise PolicySchemaError(f"{path}.tiles", f"must be a whole number from 1 to {MAX_TILES}, got {tiles!r}")
    if tiles > 1:
        if action != Action.RECOMPUTE or not spec.tileable:
            raise PolicySchemaError(f"{path}.tiles", f"applies only to action recompute on "
                                    f"{', '.join(TILED_OPS)} (got action {action!r} on op {op!r})")
    if action != Action.COMPRESS:
        extra = [k for k in ("codec",) if obj.get(k) is not None]
        if extra:
            raise PolicySchemaError(f"{path}.codec", f"must be absent for action {action!r}")
        return Decision(action, tiles=tiles)
    codec = _require(obj, "codec", path + ".", str)
    if codec not in CODECS:
        raise PolicySchemaError(f"{path}.codec", f"is {codec!r}; known codecs: {', '.join(CODECS)}")
    if codec not in spec.codecs:
        raise PolicySchemaError(f"{path}.codec", f"{codec!r} does not apply to op {op!r}; "
                                f"it accepts {', '.join(spec.codecs)}")
    params = obj.get("codec_params", {})
    if not isinstance(params, dict):
        raise PolicySchemaError(f"{path}.codec_params", f"must be an object, got {type(params).__name__}")
    for k, v in params.items():
        if not isinstance(v, (int, float, str, bool)) or (isinstance(v, float) and not math.isfinite(v)):
            raise PolicySchemaError(f"{path}.codec_params.{k}", f"must be a finite number, string or boolean, "
                                    f"got {v!r}")
    try:  # the codec itself knows its parameters and their ranges
        get_codec(codec, **params)
    except (TypeError, ValueError) as exc:
        raise PolicySchemaError(f"{path}.codec_params", f"are not valid for {codec}: {exc}") from None
    return Decision(Action.COMPRESS, codec, dict(params))


def _check_figures(figures: dict, path: str, skip: tuple[str, ...] = ()) -> None:
    for k, v in figures.items():
        if k in skip:
            continue
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise PolicySchemaError(f"{path}{k}", f"must be a finite number or null, got {v!r}")


def _check_stages(stages: Any, num_layers: int) -> None:
    """``predicted.stages``: each pipeline stage's prediction, the stages' layers one after another, every layer
    in one (:meth:`Policy.join`)."""
    if not isinstance(stages, list) or not stages:
        raise PolicySchemaError("predicted.stages", "must be a non-empty list of the pipeline stages' predictions")
    first = 0
    for i, stage in enumerate(stages):
        path = f"predicted.stages[{i}]"
        if not isinstance(stage, dict):
            raise PolicySchemaError(path, f"must be an object, got {type(stage).__name__}")
        start, count = _require(stage, "first_layer", path + ".", int), _require(stage, "num_layers", path + ".", int)
        if start != first or count < 1:
            raise PolicySchemaError(path, f"covers layers {start}..{start + count - 1}; the stage after layer "
                                    f"{first - 1} must start at layer {first} and hold at least one")
        _check_figures(stage, path + ".")
        first += count
    if first != num_layers:
        raise PolicySchemaError("predicted.stages", f"cover {first} layers but the policy has {num_layers}")


def policy_from_json(obj: Any, *, source: str | None = None) -> Policy:
    """Validate a decoded policy file and build the :class:`Policy`."""
    try:
        return _policy_from_json(obj)
    except PolicySchemaError as e:
        if source is None:
            raise
        raise PolicySchemaError(e.field, str(e).split(f"field '{e.field}' ", 1)[1], source) from None


def _policy_from_json(obj: Any) -> Policy:
    if not isinstance(obj, dict):
        raise PolicySchemaError("$", f"must be a JSON object, got {type(obj).__name__}")
    fmt = _require(obj, "format", "", str)
    if fmt != FORMAT:
        raise PolicySchemaError("format", f"is {fmt!r}; expected {FORMAT!r}")
    version = _require(obj, "schema_version", "", int)
    if version not in READABLE:
        raise PolicySchemaError("schema_version", f"is {version}; this megatron-adacc reads versions "
                                f"{', '.join(map(str, sorted(READABLE)))} (re-solve the policy with this version)")
    op_names = READABLE[version]
    name = _require(obj, "name", "", str, nullable=True) if "name" in obj else None
    sig = _require(obj, "model_signature", "", dict, nullable=True)
    if sig is not None:
        for f, kind in SIGNATURE_TYPES.items():
            value = _require(sig, f, "model_signature.", kind, nullable=f in NULLABLE_FIELDS)
            if kind is int and value is not None and value < 1:
                raise PolicySchemaError(f"model_signature.{f}", f"must be a positive integer, got {value}")
        unknown = sorted(set(sig) - set(SIGNATURE_FIELDS))
        if unknown:
            raise PolicySchemaError(f"model_signature.{unknown[0]}", "is not a signature field "
                                    f"(fields: {', '.join(SIGNATURE_FIELDS)})")
    budget = _require(obj, "budget_bytes", "", int, nullable=True)
    if budget is not None and budget <= 0:
        raise PolicySchemaError("budget_bytes", f"must be positive, got {budget}")
    ops = _require(obj, "ops", "", list)
    if list(ops) != list(op_names):
        raise PolicySchemaError("ops", f"is {ops}; version {version} files decide on the ops "
                                f"{list(op_names)} in that order")
    layers_json = _require(obj, "layers", "", list)
    if not layers_json:
        raise PolicySchemaError("layers", "must hold at least one layer")
    layers: list[list[Decision]] = []
    for index, layer in enumerate(layers_json):
        lp = f"layers[{index}]"
        if not isinstance(layer, dict):
            raise PolicySchemaError(lp, f"must be an object, got {type(layer).__name__}")
        decs = _require(layer, "decisions", lp + ".", list)
        if len(decs) != len(op_names):
            raise PolicySchemaError(f"{lp}.decisions", f"has {len(decs)} entries; expected {len(op_names)}, "
                                    "one per op")
        read = {op: _decision_from_json(d, f"{lp}.decisions[{i}]", op, op_names)
                for i, (d, op) in enumerate(zip(decs, op_names))}
        layers.append([read.get(op, Decision.keep()) for op in OP_NAMES])
        try:
            check_tiles(dict(zip(OP_NAMES, layers[-1])))
        except ValueError as exc:
            raise PolicySchemaError(f"{lp}.decisions", str(exc)) from None
    if sig is not None and sig["num_layers"] != len(layers):
        raise PolicySchemaError("layers", f"has {len(layers)} layers but model_signature.num_layers is "
                                f"{sig['num_layers']}")
    predicted = _require(obj, "predicted", "", dict) if "predicted" in obj else {}
    _check_figures(predicted, "predicted.", skip=("per_layer", "stages"))
    if "stages" in predicted:
        _check_stages(predicted["stages"], len(layers))
    solver = _require(obj, "solver", "", dict) if "solver" in obj else {}
    profile = _require(obj, "profile", "", dict, nullable=True) if "profile" in obj else None
    costs = _op_costs_from_json(obj["op_costs"]) if obj.get("op_costs") is not None else None
    return Policy(layers=layers, signature=sig, budget_bytes=budget, predicted=predicted, solver=solver,
                  profile=profile, name=name, op_costs=costs)


def _count(obj: dict, key: str, path: str, kind: type) -> Any:
    """A non-negative finite number (``kind`` int: a byte count) at ``path + key``."""
    value = _require(obj, key, path, kind if kind is int else (int, float))
    if not (math.isfinite(value) and value >= 0):
        raise PolicySchemaError(f"{path}{key}", f"must be a finite number >= 0, got {value!r}")
    return value


def _op_costs_from_json(costs: Any) -> dict[str, dict[str, Any]]:
    """``op_costs`` (optional; files written before it existed have none): per op, bytes and times."""
    if not isinstance(costs, dict):
        raise PolicySchemaError("op_costs", f"must be an object, got {type(costs).__name__}")
    out = {}
    for op, cost in costs.items():
        path = f"op_costs.{op}"
        if op not in OP_NAMES:
            raise PolicySchemaError(path, f"is not an op; the ops are {', '.join(OP_NAMES)}")
        if not isinstance(cost, dict):
            raise PolicySchemaError(path, f"must be an object, got {type(cost).__name__}")
        codecs = _require(cost, "codecs", path + ".", dict) if "codecs" in cost else {}
        for name, codec in codecs.items():
            if not isinstance(codec, dict):
                raise PolicySchemaError(f"{path}.codecs.{name}", f"must be an object, got {type(codec).__name__}")
            for key, kind in (("compressed_bytes", int), ("time_s", float)):
                _count(codec, key, f"{path}.codecs.{name}.", kind)
        out[op] = {"saved_bytes": _count(cost, "saved_bytes", path + ".", int),
                   "recompute_time_s": _count(cost, "recompute_time_s", path + ".", float),
                   "codecs": {name: dict(codec) for name, codec in codecs.items()}}
    return out


def load_policy(path: str | os.PathLike, *, signature: dict[str, Any] | None = None) -> Policy:
    """Read and validate a policy file; with ``signature``, refuse a policy made for another model."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"policy file {str(path)!r} {'is a folder' if path.is_dir() else 'does not exist'} "
                            "(make one with `adacc solve`, or use --adacc-policy auto|keep|recompute|quantize-all)")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PolicySchemaError("$", f"is not valid JSON: {e}", str(path)) from None
    except UnicodeDecodeError:
        raise PolicySchemaError("$", "is not UTF-8 text (a binary file, or another encoding); policy files are "
                                "JSON written by `adacc solve`", str(path)) from None
    except RecursionError:
        raise PolicySchemaError("$", "nests deeper than any policy file does", str(path)) from None
    policy = policy_from_json(obj, source=str(path))
    if signature is not None:
        check_signature(f"policy {path}", policy.signature, signature)
        if policy.signature is None and policy.num_layers != signature.get("num_layers"):
            raise PolicySchemaError("layers", f"has {policy.num_layers} layers but the model has "
                                    f"{signature.get('num_layers')} (--num-layers)", str(path))
    return policy
