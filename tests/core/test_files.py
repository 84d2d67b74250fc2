"""core.files.atomic_write: a crash keeps the previous file; a planted link is never followed."""

from __future__ import annotations

import pytest

from megatron_adacc.core.files import atomic_write


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text("previous")

    def fails(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fails)
    assert path.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.json"]


def test_links_planted_at_the_old_predictable_names_are_left_alone(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "out" / "policy.json"
    path.parent.mkdir()
    for name in ("policy.json.tmp", "policy.tmp", "policy.json.partial"):
        (path.parent / name).symlink_to(victim)
    assert atomic_write(path, lambda f: f.write(b"new")) == path
    assert path.read_text() == "new" and victim.read_text() == "precious"
