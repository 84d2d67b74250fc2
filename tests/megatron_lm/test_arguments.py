"""The argument provider the patched ``pretrain_gpt.py`` passes to ``parse_and_validate_args``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_adacc.arguments import add_adacc_args
from megatron_adacc.megatron_lm import FEATURES, add_our_args, enabled_features, extra_args_provider

DATA = Path(__file__).parent / "data"


def _megatron_like_parser() -> argparse.ArgumentParser:
    """A stand-in for Megatron-LM's parser: same construction, a few of its real flags."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--recompute-granularity", choices=("full", "selective"))
    return parser


def _our_option_strings() -> set[str]:
    probe = add_adacc_args(argparse.ArgumentParser(add_help=False))
    return {o for a in probe._actions for o in a.option_strings}


def test_provider_alone_adds_our_flags_and_keeps_megatrons():
    parser = extra_args_provider(None)(_megatron_like_parser())
    args = parser.parse_args(["--micro-batch-size", "4", "--adacc-policy", "auto", "--resireduce", "w",
                              "--grad-compressor", "dgc", "--grad-compress-density", "0.05",
                              "--gact-level", "L1", "--adama"])
    assert args.micro_batch_size == 4
    assert (args.adacc_policy, args.resireduce, args.grad_compressor) == ("auto", "w", "dgc")
    assert args.grad_compress_density == pytest.approx(0.05)
    assert (args.gact_level, args.adama) == ("L1", True)
    assert [f.name for f in enabled_features(args)] == ["adacc", "resireduce", "gact", "adama"]


def test_chain_runs_the_existing_provider_first_and_keeps_its_flags():
    calls = []

    def modelopt_like(parser):
        calls.append(set(parser._option_string_actions))
        parser.add_argument_group("modelopt").add_argument("--export-te-mcore-model", action="store_true")
        return parser

    parser = extra_args_provider(modelopt_like)(_megatron_like_parser())
    assert len(calls) == 1 and "--adacc-policy" not in calls[0]  # ran before ours were added
    args = parser.parse_args(["--export-te-mcore-model", "--adacc-policy", "none"])
    assert args.export_te_mcore_model is True and args.adacc_policy == "none"


def test_chain_tolerates_a_provider_that_returns_none():
    def mutating(parser):
        parser.add_argument("--extra-flag", type=int, default=3)

    args = extra_args_provider(mutating)(_megatron_like_parser()).parse_args([])
    assert args.extra_flag == 3 and args.adacc_policy == "none"


def test_chaining_twice_adds_the_flags_once():
    parser = extra_args_provider(extra_args_provider(None))(_megatron_like_parser())
    assert sum(a.dest == "adacc_policy" for a in parser._actions) == 1


def test_a_clash_with_a_megatron_flag_names_the_flag():
    parser = _megatron_like_parser()
    parser.add_argument("--adama", action="store_true")  # a future Megatron-LM growing one of our names
    with pytest.raises(RuntimeError, match=r"already defines --adama"):
        add_our_args(parser)


def test_defaults_turn_every_feature_off():
    args = extra_args_provider(None)(_megatron_like_parser()).parse_args([])
    assert enabled_features(args) == []
    for feature in FEATURES:
        assert getattr(args, feature.dest) == feature.off


def test_unknown_flags_still_fail_like_argparse():
    parser = extra_args_provider(None)(_megatron_like_parser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--adacc-polcy", "auto"])  # typo: argparse must refuse it, not guess


@pytest.mark.parametrize("path", sorted(DATA.glob("megatron_lm_flags_*.txt")), ids=lambda p: p.stem)
def test_no_flag_collides_with_megatron_lm(path):
    """Megatron-LM's real option strings at the pinned commit (scripts/megatron_lm_cpu_check.py --list-flags)."""
    megatron = {line for line in path.read_text().split() if line.startswith("--")}
    assert len(megatron) > 500 and "--micro-batch-size" in megatron and "--recompute-granularity" in megatron
    assert not (_our_option_strings() & megatron)
