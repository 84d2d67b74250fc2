"""Policy objects, presets, JSON round trip, schema validation errors, and signature checks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_adacc.adacc.policy import Decision, Policy, load_policy, save_policy
from megatron_adacc.adacc.policy.io import SCHEMA_PATH, PolicySchemaError, policy_from_json, policy_to_json
from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS
from megatron_adacc.adacc.policy.schema import render
from megatron_adacc.adacc.policy.signature import SignatureMismatchError, model_signature, plain_signature

SIG = plain_signature(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32, micro_batch_size=2,
                      dtype="float32", num_layers=3, megatron_core_version="0.16.1")


def solved_like_policy() -> Policy:
    layer = [Decision.keep() if i % 3 == 0 else Decision.recompute() if i % 3 == 1 else
             Decision.compress(OPS[i].default_codec) for i in range(len(OPS))]
    layer[0] = Decision.compress("int4_outlier", z_threshold=2.5)
    return Policy(layers=[list(layer) for _ in range(3)], signature=dict(SIG), budget_bytes=10**9,
                  predicted={"memory_bytes": 123, "time_s": 0.5}, solver={"strategy": "paper", "status": "Optimal"},
                  profile={"db": "/tmp/x.sqlite", "id": 1}, name="adacc")


def test_presets() -> None:
    keep = Policy.all_keep(2)
    assert all(d.action == "keep" for layer in keep.layers for d in layer)
    rec = Policy.all_recompute(2)
    assert rec.layers[0][0].action == "keep"  # the checkpoint (eq. 6)
    assert all(d.action == "recompute" for d in rec.layers[1][1:])
    q = Policy.quantize_all(2)
    assert all(d.action == "compress" and d.codec == "int4_symmetric" for layer in q.layers for d in layer)
    assert Policy.preset("quantize_all", 2).layers == q.layers
    with pytest.raises(ValueError, match="presets are keep, recompute, quantize-all"):
        Policy.preset("fast", 2)


def test_uniform_from_maps() -> None:
    p = Policy.uniform({"softmax": "compress", "linear_fc1": "recompute", "dropout": "int4_symmetric"}, 2)
    assert p.decision(1, "softmax") == Decision.compress("int4_asymmetric")
    assert p.decision(0, "linear_fc1").action == "recompute"
    assert p.decision(0, "dropout").codec == "int4_symmetric"
    assert p.decision(0, "mlp_bda").action == "keep"
    with pytest.raises(ValueError, match="does not apply to op 'linear_qkv'"):
        Policy.uniform({"linear_qkv": "bitmask"}, 1)
    with pytest.raises(ValueError, match="unknown op"):
        Policy.uniform({"attention": "keep"}, 1)
    with pytest.raises(ValueError, match="cannot be recomputed"):
        Policy.uniform([Decision.recompute()] * len(OPS), 1)


def test_round_trip(tmp_path) -> None:
    p = solved_like_policy()
    path = save_policy(p, tmp_path / "p.json")
    q = load_policy(path, signature=dict(SIG))
    assert q.layers == p.layers and q.signature == p.signature and q.budget_bytes == p.budget_bytes
    assert q.decision(0, "layer_input").codec_params == {"z_threshold": 2.5}
    assert q.predicted == p.predicted and q.solver == p.solver and q.profile == p.profile


@pytest.mark.parametrize("mutate, field", [
    (lambda o: o.pop("format"), "format"),
    (lambda o: o.update(schema_version=99), "schema_version"),
    (lambda o: o["model_signature"].pop("seq_length"), "model_signature.seq_length"),
    (lambda o: o["model_signature"].update(hidden_size="64"), "model_signature.hidden_size"),
    (lambda o: o.update(budget_bytes=-5), "budget_bytes"),
    (lambda o: o.update(budget_bytes=True), "budget_bytes"),
    (lambda o: o.update(ops=list(reversed(OP_NAMES))), "ops"),
    (lambda o: o.update(layers=[]), "layers"),
    (lambda o: o["layers"][1]["decisions"].pop(), "layers[1].decisions"),
    (lambda o: o["layers"][2]["decisions"][4].update(action="drop"), "layers[2].decisions[4].action"),
    (lambda o: o["layers"][0]["decisions"][4].update(op="scores"), "layers[0].decisions[4].op"),
    (lambda o: o["layers"][0]["decisions"][2].update(codec="int4_fancy"), "layers[0].decisions[2].codec"),
    (lambda o: o["layers"][0]["decisions"][2].pop("codec"), "layers[0].decisions[2].codec"),
    (lambda o: o["layers"][0]["decisions"][0].update(action="recompute", codec=None), "layers[0].decisions[0].action"),
    (lambda o: o["layers"][1]["decisions"][2].update(codec_params={"group": [1]}),
     "layers[1].decisions[2].codec_params.group"),
    (lambda o: o["layers"][1]["decisions"][1].update(codec="int4_outlier"), "layers[1].decisions[1].codec"),
    (lambda o: o["predicted"].update(time_s="fast"), "predicted.time_s"),
    (lambda o: o["layers"].pop(), "layers"),  # 2 layers but num_layers says 3
])
def test_schema_errors_name_the_field(mutate, field) -> None:
    obj = policy_to_json(solved_like_policy())
    mutate(obj)
    with pytest.raises(PolicySchemaError) as info:
        policy_from_json(obj)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)


def test_a_version_2_file_runs_as_it_did(tmp_path) -> None:
    """Version 2 files have no layer_input op (the layer input was always kept): read with it kept, every other
    decision as written; a version 2 file with version 3's op list is refused."""
    policy = solved_like_policy()
    obj = policy_to_json(policy)
    obj["schema_version"], obj["ops"] = 2, list(OP_NAMES[1:])
    for layer in obj["layers"]:
        del layer["decisions"][0]
    old = policy_from_json(obj)
    assert [layer[0] for layer in old.layers] == [Decision.keep()] * 3
    assert [layer[1:] for layer in old.layers] == [layer[1:] for layer in policy.layers]
    obj["ops"] = list(OP_NAMES)
    with pytest.raises(PolicySchemaError, match="version 2 files decide on the ops"):
        policy_from_json(obj)


def test_load_names_the_file_and_field(tmp_path) -> None:
    obj = policy_to_json(solved_like_policy())
    obj["layers"][0]["decisions"][5]["action"] = "zip"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    field = r"field 'layers\[0\]\.decisions\[5\]\.action'"
    with pytest.raises(PolicySchemaError, match=r"bad\.json: invalid policy file: " + field):
        load_policy(path)
    path.write_text("{not json")
    with pytest.raises(PolicySchemaError, match="not valid JSON"):
        load_policy(path)
    with pytest.raises(FileNotFoundError, match="adacc solve"):
        load_policy(tmp_path / "missing.json")


def test_signature_mismatch_is_refused_listing_fields(tmp_path) -> None:
    path = save_policy(solved_like_policy(), tmp_path / "p.json")
    other = dict(SIG, seq_length=64, micro_batch_size=4)
    with pytest.raises(SignatureMismatchError) as info:
        load_policy(path, signature=other)
    assert set(info.value.diff) == {"seq_length", "micro_batch_size"}
    msg = str(info.value)
    assert "seq_length: 32 in the policy" in msg and "vs 64 in this run" in msg and "micro_batch_size" in msg
    assert "hidden_size" not in msg


def test_model_signature_from_config_and_args() -> None:
    import torch

    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, ffn_hidden_size=None, num_layers=3,
                             params_dtype=torch.bfloat16, bf16=True)
    args = SimpleNamespace(seq_length=32, micro_batch_size=2)
    sig = model_signature(config, args)
    assert sig["ffn_hidden_size"] == 256 and sig["dtype"] == "bfloat16" and sig["seq_length"] == 32
    assert sig["num_layers"] == 3 and sig["megatron_core_version"]
    with pytest.raises(ValueError, match="micro_batch_size"):
        model_signature(config, SimpleNamespace(seq_length=32))


def test_published_schema_is_in_sync() -> None:
    assert SCHEMA_PATH.read_text() == render(), "run: python -m megatron_adacc.adacc.policy.schema"


def test_published_schema_accepts_a_written_policy() -> None:
    """A light structural check of the schema against a real file (no jsonschema dependency)."""
    schema = json.loads(SCHEMA_PATH.read_text())
    obj = policy_to_json(solved_like_policy())
    assert set(schema["required"]) <= set(obj)
    assert schema["properties"]["ops"]["const"] == obj["ops"]
    allowed = {c["if"]["properties"]["op"]["const"]: set(c["then"]["properties"]["codec"]["enum"])
               for c in schema["$defs"]["decision"]["allOf"][1:] if "codec" in c["then"].get("properties", {})}
    for layer in obj["layers"]:
        for d in layer["decisions"]:
            if d["action"] == "compress":
                assert d["codec"] in allowed[d["op"]]


def test_a_pipeline_stage_takes_its_slice_of_a_whole_model_policy() -> None:
    layers = [Policy.all_keep(1).layers[0], Policy.all_recompute(1).layers[0], Policy.quantize_all(1).layers[0]]
    whole = Policy(layers=[list(x) for x in layers], predicted={"memory_bytes": 1.0})
    stage = whole.stage(1, 2)
    assert stage.layers == [layers[1], layers[2]] and stage.predicted == {}
    assert whole.num_layers == 3 and whole.predicted  # the whole-model policy is untouched
    assert isinstance(stage.layers[0][0], Decision)
    for first, count in ((2, 2), (-1, 1), (0, 0)):
        with pytest.raises(ValueError, match="not within this policy's 3 layers"):
            whole.stage(first, count)


@pytest.mark.parametrize("content, problem", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not UTF-8 text"),
    ("caf\xe9".encode("latin-1"), "is not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
])
def test_unreadable_policy_files_are_schema_errors_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "policy.json"
    path.write_bytes(content)
    with pytest.raises(PolicySchemaError, match=problem) as info:
        load_policy(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("params, problem", [
    ({"z_threshold": -1.0}, "positive finite number"),
    ({"z_threshold": 0}, "positive finite number"),
    ({"zz_threshold": 3.0}, "not valid for int4_outlier"),
])
def test_codec_params_are_validated_at_load(params, problem):
    """A negative Z threshold used to load and silently keep every channel of those tensors uncompressed."""
    from megatron_adacc.adacc.policy.ops import OUTLIER_CODEC

    at = next(i for i, spec in enumerate(OPS) if OUTLIER_CODEC in spec.codecs)
    layer = [Decision.keep() for _ in OPS]
    layer[at] = Decision.compress(OUTLIER_CODEC, z_threshold=3.0)
    obj = policy_to_json(Policy(layers=[layer]))
    assert policy_from_json(obj).layers[0][at].codec == OUTLIER_CODEC  # valid as written
    obj["layers"][0]["decisions"][at]["codec_params"] = params
    with pytest.raises(PolicySchemaError, match=problem):
        policy_from_json(obj)


def test_every_signature_field_changes_the_key() -> None:
    from megatron_adacc.adacc.policy.signature import SIGNATURE_TYPES, signature_key

    base = dict(SIG)
    other = {int: lambda v: (v or 1) + 1, str: lambda v: v + "x", bool: lambda v: not v}
    keys = {signature_key(base)}
    for field, kind in SIGNATURE_TYPES.items():
        changed = dict(base, **{field: other[kind](base[field])})
        keys.add(signature_key(changed))
        assert signature_key(changed) != signature_key(base), field
    assert len(keys) == len(SIGNATURE_TYPES) + 1


def test_model_signature_reads_the_layer_structure_and_the_parallel_layout() -> None:
    import torch

    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                             num_layers=3, gated_linear_unit=True, normalization="RMSNorm", params_dtype=torch.float32,
                             tensor_model_parallel_size=2, pipeline_model_parallel_size=3, sequence_parallel=True)
    args = SimpleNamespace(seq_length=32, micro_batch_size=2, position_embedding_type="rope",
                           attention_backend="flash", padded_vocab_size=50304,
                           untie_embeddings_and_output_weights=True)
    sig = model_signature(config, args)
    assert {k: sig[k] for k in ("num_query_groups", "gated_linear_unit", "normalization", "position_embedding_type",
                                "attention", "vocab_size", "untie_embeddings_and_output_weights",
                                "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel")} == {
        "num_query_groups": 2, "gated_linear_unit": True, "normalization": "RMSNorm",
        "position_embedding_type": "rope", "attention": "sdpa", "vocab_size": 50304,
        "untie_embeddings_and_output_weights": True, "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 3, "sequence_parallel": True}
    # Megatron-LM selects the SDPA layer by --spec, whatever --attention-backend says
    spec = SimpleNamespace(**{**vars(args), "attention_backend": "auto",
                              "spec": ["megatron_adacc.models.attention", "SDPA_LAYER_SPEC"]})
    assert model_signature(config, spec)["attention"] == "sdpa"


def test_a_version_1_policy_file_is_refused_with_the_fix(tmp_path) -> None:
    obj = policy_to_json(solved_like_policy())
    obj["schema_version"] = 1
    obj["model_signature"] = {k: obj["model_signature"][k] for k in ("hidden_size", "num_attention_heads",
                                                                     "ffn_hidden_size", "seq_length", "dtype",
                                                                     "micro_batch_size", "num_layers",
                                                                     "megatron_core_version")}
    (tmp_path / "old.json").write_text(json.dumps(obj))
    with pytest.raises(PolicySchemaError, match="schema_version.*re-solve"):
        load_policy(tmp_path / "old.json")
