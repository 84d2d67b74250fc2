"""The published JSON Schema of policy files, generated from :mod:`megatron_adacc.adacc.policy.ops`.

``python -m megatron_adacc.adacc.policy.schema`` rewrites ``policy.schema.json``; a test keeps the two in sync.
The loader (:mod:`megatron_adacc.adacc.policy.io`) validates the same rules by hand, naming the failing field.
"""

from __future__ import annotations

import json
from typing import Any

from megatron_adacc.adacc.policy.io import FORMAT, SCHEMA_PATH, SCHEMA_VERSION
from megatron_adacc.adacc.policy.ops import ACTIONS, CODECS, MAX_TILES, OP_NAMES, OPS, TILED_OPS, Action
from megatron_adacc.adacc.policy.signature import NULLABLE_FIELDS, SIGNATURE_FIELDS, SIGNATURE_TYPES


def json_schema() -> dict[str, Any]:
    json_type = {int: {"type": "integer", "minimum": 1}, str: {"type": "string"}, bool: {"type": "boolean"}}
    sig_props = {f: ({"type": ["integer", "null"], "minimum": 1} if f in NULLABLE_FIELDS else json_type[kind])
                 for f, kind in SIGNATURE_TYPES.items()}
    decision = {
        "type": "object",
        "required": ["op", "action"],
        "properties": {
            "op": {"enum": list(OP_NAMES)},
            "action": {"enum": [a.value for a in ACTIONS]},
            "codec": {"enum": list(CODECS)},
            "codec_params": {"type": "object", "additionalProperties": {"type": ["number", "string", "boolean"]}},
            "tiles": {"type": "integer", "minimum": 1, "maximum": MAX_TILES,
                      "description": "recompute only, on " + ", ".join(TILED_OPS) + " (all three alike): re-run "
                                     "the MLP in this many token tiles"},
        },
        "allOf": [
            {"if": {"properties": {"action": {"const": Action.COMPRESS.value}}}, "then": {"required": ["codec"]},
             "else": {"not": {"required": ["codec"]}}},
            *({"if": {"properties": {"op": {"const": op.name}, "action": {"const": Action.COMPRESS.value}}},
               "then": {"properties": {"codec": {"enum": list(op.codecs)}}}} for op in OPS),
            *({"if": {"properties": {"op": {"const": op.name}}},
               "then": {"properties": {"action": {"enum": [Action.KEEP.value, Action.COMPRESS.value]}}}}
              for op in OPS if not op.recomputable),
            {"if": {"required": ["tiles"], "properties": {"tiles": {"minimum": 2}}},
             "then": {"properties": {"action": {"const": Action.RECOMPUTE.value}, "op": {"enum": list(TILED_OPS)}}}},
        ],
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "megatron-adacc/policy.schema.json",
        "title": "megatron-adacc policy file",
        "description": f"Per-layer, per-op activation decisions (keep / compress / recompute) for megatron-core "
                       f"TransformerLayers. Schema version {SCHEMA_VERSION}. See docs/policy-schema.md.",
        "type": "object",
        "required": ["format", "schema_version", "model_signature", "budget_bytes", "ops", "layers"],
        "properties": {
            "format": {"const": FORMAT},
            "schema_version": {"const": SCHEMA_VERSION},
            "name": {"type": ["string", "null"]},
            "model_signature": {"oneOf": [
                {"type": "null"},
                {"type": "object", "required": list(SIGNATURE_FIELDS), "additionalProperties": False,
                 "properties": sig_props}]},
            "budget_bytes": {"type": ["integer", "null"], "exclusiveMinimum": 0},
            "ops": {"const": list(OP_NAMES)},
            "layers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["decisions"],
                "properties": {"decisions": {
                    "type": "array", "minItems": len(OPS), "maxItems": len(OPS),
                    "prefixItems": [{"allOf": [{"$ref": "#/$defs/decision"}, {"properties": {"op": {"const": n}}}]}
                                    for n in OP_NAMES]}}}},
            "predicted": {"type": "object",
                          "description": "memory_bytes, static_bytes, workspace_bytes, activation_bytes, "
                                         "time_s (overhead per micro-batch), per_layer; a pipeline's policy, "
                                         "each stage's own in stages",
                          "properties": {"per_layer": {"type": "array", "items": {"type": "object"}},
                                         "stages": {"type": "array", "minItems": 1, "items": {
                                             "type": "object", "required": ["first_layer", "num_layers"],
                                             "properties": {"first_layer": {"type": "integer", "minimum": 0},
                                                            "num_layers": {"type": "integer", "minimum": 1}},
                                             "additionalProperties": {"type": ["number", "null"]}}}},
                          "additionalProperties": {"type": ["number", "null"]}},
            "solver": {"type": "object",
                       "description": "strategy, status, solve_time_s, chain_aware, heterogeneous, ..."},
            "profile": {"type": ["object", "null"],
                        "description": "db, id, device, source, created_at of the profile the policy was solved from"},
            "op_costs": {"type": "object",
                         "description": "per op, under the profile it was solved from: bytes if kept, recompute "
                                        "time, and compressed bytes and compress + decompress time of the codecs "
                                        "the policy uses (optional; `adacc show` prints them)",
                         "propertyNames": {"enum": list(OP_NAMES)},
                         "additionalProperties": {"$ref": "#/$defs/op_cost"}},
        },
        "$defs": {"decision": decision, "op_cost": _op_cost()},
    }


def _op_cost() -> dict[str, Any]:
    count, seconds = {"type": "integer", "minimum": 0}, {"type": "number", "minimum": 0}
    return {"type": "object", "required": ["saved_bytes", "recompute_time_s"],
            "properties": {"saved_bytes": count, "recompute_time_s": seconds,
                           "codecs": {"type": "object", "propertyNames": {"enum": list(CODECS)},
                                      "additionalProperties": {"type": "object",
                                                               "required": ["compressed_bytes", "time_s"],
                                                               "properties": {"compressed_bytes": count,
                                                                              "time_s": seconds}}}}}


def render() -> str:
    return json.dumps(json_schema(), indent=1) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}")
