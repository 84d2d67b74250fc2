"""The one lookup of ``configs/*.toml``: the checkout's top-level folder, or the copy a wheel carries."""

from pathlib import Path

import pytest

from megatron_adacc.core import config_files
from megatron_adacc.core.errors import AdaccError

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_checkout_finds_the_top_level_configs():
    assert config_files.config_dir() == REPO_CONFIGS
    assert config_files.find("tiny") == REPO_CONFIGS / "tiny.toml"
    assert config_files.find("tiny.toml") == REPO_CONFIGS / "tiny.toml"
    assert config_files.find(str(REPO_CONFIGS / "gpt-345m.toml")) == REPO_CONFIGS / "gpt-345m.toml"
    assert config_files.find("does-not-exist") is None
    assert {"tiny", "gpt-345m"} <= set(config_files.known())


def test_the_package_copy_of_an_installed_wheel_wins(tmp_path, monkeypatch):
    (tmp_path / "only-here.toml").write_text("num_layers = 1\n")
    monkeypatch.setattr(config_files, "_PACKAGE_COPY", tmp_path)
    assert config_files.config_dir() == tmp_path
    assert config_files.find("only-here") == tmp_path / "only-here.toml"
    assert config_files.known() == ["only-here"]


def test_both_hosts_use_it(tmp_path, monkeypatch):
    """`adacc train --config` and the Megatron-LM translation resolve names in the same folder."""
    from megatron_adacc.megatron_lm import configs
    from megatron_adacc.training.args import resolve_config

    (tmp_path / "only-here.toml").write_text("num_layers = 1\n")
    monkeypatch.setattr(config_files, "_PACKAGE_COPY", tmp_path)
    assert resolve_config("only-here") == configs.resolve("only-here") == tmp_path / "only-here.toml"
    with pytest.raises(AdaccError, match="known: only-here"):
        resolve_config("tiny")
