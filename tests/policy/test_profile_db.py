"""The SQLite profile store and the profile data model."""

from __future__ import annotations

import pytest

from megatron_adacc.adacc.policy.profile import LayerProfile, StashedOutput, analytic_profile
from megatron_adacc.adacc.policy.profile_db import ENV_VAR, ProfileDB, default_db_path
from megatron_adacc.adacc.policy.signature import plain_signature

SIG = plain_signature(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32, micro_batch_size=2,
                      dtype="float32", num_layers=3, megatron_core_version="0.16.1")


def test_round_trip_and_keying(tmp_path) -> None:
    db = ProfileDB(tmp_path / "p.sqlite")
    a = analytic_profile(SIG, device="cpu:test")
    a.segment_times_s = {(1, 3): 0.25}
    a.ops[2].stash = [StashedOutput(("scores", "context"), {"keep": 7}, 9)]
    pid = db.put(a)
    got = db.get("cpu:test", SIG)
    assert got is not None and got[0] == pid
    assert got[1].to_json() == a.to_json()
    assert got[1].segment_time(1, 3) == 0.25
    # another device or signature finds nothing
    assert db.get("cuda:H100", SIG) is None
    assert db.get("cpu:test", dict(SIG, micro_batch_size=4)) is None
    # the newest profile wins
    b = analytic_profile(SIG, device="cpu:test", outlier_fraction=0.5)
    b.created_at = a.created_at + 10
    pid_b = db.put(b)
    assert db.get("cpu:test", SIG)[0] == pid_b
    assert [r["id"] for r in db.list()] == [pid, pid_b]
    assert db.get_by_id(pid).to_json() == a.to_json()
    with pytest.raises(KeyError, match="no profile with id 999"):
        db.get_by_id(999)


def test_a_profile_of_an_older_format_is_not_reused(tmp_path) -> None:
    """A stored profile whose format predates this code reads as missing, so `auto` profiles again instead of
    solving with figures that mean something else."""
    import json
    import sqlite3

    db = ProfileDB(tmp_path / "p.sqlite")
    pid = db.put(analytic_profile(SIG, device="cpu:test"))
    assert db.get("cpu:test", SIG) is not None
    with sqlite3.connect(db.path) as con:
        payload = json.loads(con.execute("SELECT payload FROM profiles WHERE id = ?", (pid,)).fetchone()[0])
        payload["profile_version"] = 1
        con.execute("UPDATE profiles SET payload = ? WHERE id = ?", (json.dumps(payload), pid))
    assert db.get("cpu:test", SIG) is None


def test_default_path_env_and_flag(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env.sqlite"))
    assert default_db_path() == tmp_path / "env.sqlite"
    assert default_db_path(tmp_path / "flag.sqlite") == tmp_path / "flag.sqlite"
    monkeypatch.delenv(ENV_VAR)
    assert str(default_db_path()).endswith(".cache/megatron-adacc/profile.sqlite")


def test_segment_time_falls_back_to_sum_plus_overhead() -> None:
    p = analytic_profile(SIG)
    p.segment_overhead_s = 0.5
    assert p.segment_time(2, 4) == pytest.approx(sum(op.forward_time_s for op in p.ops[2:5]) + 0.5)


def test_profile_rejects_wrong_ops_and_versions() -> None:
    p = analytic_profile(SIG)
    obj = p.to_json()
    obj["ops"] = obj["ops"][:-1]
    with pytest.raises(ValueError, match="do not match the layer's ops"):
        LayerProfile.from_json(obj)
    obj = p.to_json()
    obj["profile_version"] = 0
    with pytest.raises(ValueError, match="re-run `adacc profile`"):
        LayerProfile.from_json(obj)


def test_analytic_sizes_are_the_grouped_codecs_formulas() -> None:
    """The analytic profile's shape-free sizes equal the codecs' ``compressed_nbytes`` for the grouped codecs
    and the bitmask (every tensor here is a whole number of 128-value groups); the channel-wise and outlier
    codecs' formulas need the tensor's layout, which the analytic model leaves out (see its docstring)."""
    import torch

    from megatron_adacc.adacc.policy.profile import op_output_elements
    from megatron_adacc.codecs import get_codec

    grouped = {"int4_symmetric": get_codec("int4_symmetric", group=128),
               "int4_asymmetric": get_codec("int4_asymmetric", group=128),
               "stochastic": get_codec("stochastic", group_size=128), "bitmask": get_codec("bitmask")}
    elements = op_output_elements(SIG)
    checked = 0
    for op in analytic_profile(SIG, group_size=128).ops:
        assert elements[op.name] % 128 == 0
        for name, codec in grouped.items():
            if name in op.codecs:
                assert op.codecs[name].compressed_bytes == codec.compressed_nbytes((elements[op.name],), torch.float32)
                checked += 1
    assert checked >= 2 * len(elements)  # every op offers int4_symmetric and stochastic


def test_a_damaged_or_foreign_database_is_one_clear_error(tmp_path):
    from megatron_adacc.adacc.policy.profile_db import ProfileDB, ProfileDBError
    from megatron_adacc.core.errors import AdaccError

    not_a_db = tmp_path / "profile.sqlite"
    not_a_db.write_bytes(b"this is not an SQLite file" * 100)
    with pytest.raises(ProfileDBError, match=r"profile.sqlite cannot be used .*move it aside or delete it") as info:
        ProfileDB(not_a_db)
    assert isinstance(info.value, AdaccError)
    with pytest.raises(ProfileDBError, match="is a folder"):
        ProfileDB(tmp_path)
