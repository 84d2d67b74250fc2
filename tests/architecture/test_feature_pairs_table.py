"""docs/feature-pairs.md is the registry's compatibility fact, written out: regenerate it with
``python -m megatron_adacc.features`` whenever an entry's ``conflicts`` change."""

from __future__ import annotations

import pytest

from megatron_adacc import features
from megatron_adacc.core import features as core_features


def test_the_committed_table_is_the_generated_one():
    assert features.PAIR_TABLE.read_text() == features.pair_table(), \
        "docs/feature-pairs.md is stale: run `python -m megatron_adacc.features`"


def test_the_table_has_every_pair_once():
    table = features.pair_table()
    names = [f.name for f in features.FEATURES]
    assert len(features.pairs()) == len(names) * (len(names) - 1) // 2
    for pair in features.pairs():
        assert table.count(f"| `{pair.first.flag}` + `{pair.second.flag}` |") == 1
        assert (pair.refusal or "works") in table


def test_check_fails_on_a_stale_file_and_passes_once_written(tmp_path, capsys):
    out = tmp_path / "pairs.md"
    out.write_text("old\n")
    assert features.main(["--check", "--output", str(out)]) == 1
    assert "python -m megatron_adacc.features" in capsys.readouterr().err
    assert features.main(["--output", str(out)]) == 0
    assert features.main(["--check", "--output", str(out)]) == 0


def _feature(name, **conflicts):
    return core_features.Feature(name=name, flag=f"--{name}", dest=name, off=False, add_args=lambda p: None,
                                 build_extensions=lambda args, config: [], conflicts=conflicts)


def test_a_conflict_is_read_from_whichever_side_states_it():
    a, b, c = _feature("a", b="a and b: use one"), _feature("b"), _feature("c")
    assert [(p.first.name, p.second.name, p.refusal) for p in core_features.pairs([a, b, c])] == [
        ("a", "b", "a and b: use one"), ("a", "c", None), ("b", "c", None)]
    assert core_features.conflict(b, a) == "a and b: use one"


@pytest.mark.parametrize("entries, message", [
    ([_feature("a", z="a and z"), _feature("b")], "not features"),
    ([_feature("a", b="a and b"), _feature("b", a="b and a")], "both state their conflict"),
], ids=["unknown", "twice"])
def test_a_conflict_that_could_drift_is_refused(entries, message):
    with pytest.raises(ValueError, match=message):
        core_features.pairs(entries)
