"""core.features: the registry entry type and the checks both hosts run."""

from __future__ import annotations

import argparse
import types

import pytest

from megatron_adacc import features as registry
from megatron_adacc.core import features
from megatron_adacc.core.errors import FeatureUnavailable, IntegrationError
from megatron_adacc.core.extension import TrainingExtension


def _feature(name, off=False, **kwargs):
    return features.Feature(name=name, flag=f"--{name}", dest=name, off=off,
                            add_args=lambda p: p.add_argument(f"--{name}", action="store_true"),
                            build_extensions=lambda args, config: [], **kwargs)


def test_enabled_is_any_value_but_off_in_registry_order():
    a, b = _feature("a"), _feature("b", off="none")
    args = types.SimpleNamespace(a=True, b="none")
    assert features.enabled((a, b), args) == [a]
    assert features.enabled((a, b), types.SimpleNamespace(a=True, b="x")) == [a, b]
    assert features.enabled((a, b), types.SimpleNamespace()) == []  # a host without the flags: all off


def test_check_lists_every_problem_at_once_with_the_hosts_first():
    a = _feature("a", problems=lambda args: ["a: drop --x"], conflicts={"b": "a and b: use one"})
    b = _feature("b", problems=lambda args: ["b: drop --y"])
    with pytest.raises(IntegrationError) as err:
        features.check([a, b], types.SimpleNamespace(), extra=["host: drop --z"])
    assert str(err.value).split("\n  - ")[1:] == ["host: drop --z", "a and b: use one", "a: drop --x", "b: drop --y"]
    features.check([b.__class__(**{**b.__dict__, "problems": lambda args: []})], types.SimpleNamespace())


def test_a_conflict_needs_both_features_on():
    a = _feature("a", conflicts={"b": "a and b"})
    assert features.problems([a], types.SimpleNamespace()) == []


def test_unknown_hooks_are_refused_when_the_entry_is_made():
    with pytest.raises(ValueError, match="unknown hooks"):
        _feature("a", hooks=frozenset({"wrap_everything"}))


class _Wrapper(TrainingExtension):
    def __init__(self, tag):
        self.tag = tag

    def wrap_model(self, chunks, wrap, ddp_config=None):
        return [f"{self.tag}({c},{ddp_config})" for c in wrap(chunks)]

    def build_optimizer(self, chunks, build):
        return f"{self.tag}[{build(chunks)}]"


def test_the_first_extension_has_the_last_word_and_plain_ones_pass_through():
    exts = [_Wrapper("outer"), TrainingExtension(), _Wrapper("inner")]
    assert features.wrap_model(exts, ["m"], lambda c: [f"ddp({x})" for x in c], "cfg") == \
        ["outer(inner(ddp(m),cfg),cfg)"]
    assert features.build_optimizer(exts, ["m"], lambda c: "adam") == "outer[inner[adam]]"
    assert features.wrap_model([], ["m"], lambda c: ["ddp"]) == ["ddp"]


def test_require_names_the_flag_and_the_fix():
    a = _feature("a")
    assert features.require(a, "megatron_adacc.core.units", "parse_bytes")("1KiB") == 1024
    with pytest.raises(FeatureUnavailable, match=r"--a needs megatron_adacc\.nope\.x.*or run without --a"):
        features.require(a, "megatron_adacc.nope", "x")


def test_every_registered_flag_starts_with_its_features_prefix():
    """flag_prefixes is what the Megatron-LM host uses to notice flags that --yaml-cfg dropped."""
    for feature in registry.FEATURES:
        parser = argparse.ArgumentParser()
        feature.add_args(parser)
        flags = [o.replace("--no-", "--") for action in parser._actions for o in action.option_strings
                 if o.startswith("--")]
        assert feature.flag in flags
        assert [f for f in flags if f != "--help" and not f.startswith(feature.flag_prefixes)] == []
        assert getattr(parser.parse_args([]), feature.dest) == feature.off  # off by default
