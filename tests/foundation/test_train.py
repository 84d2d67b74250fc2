"""`adacc train` end to end on real megatron-core: loss falls, flags are documented, bad input is refused."""

import argparse
import json

import pytest

from megatron_adacc.core.errors import AdaccError
from megatron_adacc.training.args import add_train_args, parse_train_args
from megatron_adacc.training.loop import train

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--no-progress"]


def test_two_layer_gpt_loss_falls(tmp_path, capsys):
    out = tmp_path / "summary.json"
    summary = train(parse_train_args(SMALL + ["--train-iters", "25", "--lr", "5e-3",
                                              "--output-json", str(out)]))
    assert summary["iterations"] == 25
    first = sum(summary["losses"][:3]) / 3
    last = sum(summary["losses"][-3:]) / 3
    assert last < first - 0.5, summary["losses"]
    assert summary["num_microbatches"] == 2
    assert summary["saved_activation_bytes"] > 0
    assert summary["peak_memory_bytes"] > 0
    assert json.loads(out.read_text())["final_loss"] == summary["final_loss"]
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "peak RSS" in printed and "held for backward" in printed


def test_full_recompute_holds_less_for_backward():
    none = train(parse_train_args(SMALL + ["--train-iters", "2"]))
    full = train(parse_train_args(SMALL + ["--train-iters", "2", "--recompute-granularity", "full",
                                           "--recompute-method", "uniform", "--recompute-num-layers", "1"]))
    assert full["saved_activation_bytes"] < 0.5 * none["saved_activation_bytes"]
    assert full["losses"] == none["losses"]  # recompute is exact, so the runs are the same run


def test_every_flag_is_documented():
    parser = add_train_args(argparse.ArgumentParser())
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings[0]} has no help text"


def test_config_file_defaults_and_override():
    args = parse_train_args(["--hidden-size", "96"])
    assert args.hidden_size == 96 and args.num_layers == 4  # 4 comes from configs/tiny.toml


def test_unknown_config_is_refused():
    with pytest.raises(AdaccError, match="no such file"):
        parse_train_args(["--config", "does-not-exist"])


def test_bad_config_key_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("num_layerz = 3\n")
    with pytest.raises(AdaccError, match="num_layerz"):
        parse_train_args(["--config", str(bad)])


def test_global_batch_must_divide():
    with pytest.raises(AdaccError, match="not a multiple"):
        train(parse_train_args(SMALL + ["--global-batch-size", "6", "--train-iters", "1"]))


def test_runaway_megatron_config_is_refused_up_front():
    with pytest.raises(AdaccError, match="recurse without bound"):
        train(parse_train_args(SMALL + ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]))


def test_memory_budget_parsing():
    from megatron_adacc.arguments import parse_bytes

    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError, match="12GiB"):
        parse_bytes("lots")


@pytest.mark.parametrize("flags, message", [
    (["--num-attention-heads", "3", "--hidden-size", "128"], "not a multiple of --num-attention-heads 3"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0 must be a positive integer"),
    (["--num-layers", "-1"], "--num-layers -1 must be a positive integer"),
])
def test_impossible_shapes_are_refused_before_anything_is_built(flags, message):
    from megatron_adacc.core.errors import IntegrationError

    with pytest.raises(IntegrationError, match=message):
        parse_train_args(SMALL + flags)


def test_the_summary_of_an_auto_run_reads_as_lines_not_dicts(capsys):
    """The extensions' reports (Adacc's decisions and per-layer figures, evolution's series) used to print as
    Python reprs: ``adacc.decisions: {'keep': 52}``, a 200-character list of per-layer dicts."""
    from megatron_adacc.training.loop import _print_summary

    layers = [{"layer": i, "measured_bytes": 15745024, "predicted_bytes": None, "rel_error": None} for i in range(4)]
    summary = {"iterations": 3, "device": "cpu", "world_size": 1, "num_microbatches": 2, "first_loss": 5.5,
               "final_loss": 4.9, "step_time_s": 0.66, "tokens_per_s": 3115.0, "peak_memory_kind": "peak_rss",
               "peak_memory_bytes": 542_900_000, "saved_activation_bytes": 65_640_000, "nonfinite_activations": 0,
               "extensions": {
                   "adacc": {"policy": "adacc", "decisions": {"keep": 40, "compress:int4_outlier": 12},
                             "layer_bytes_measured": 63_000_000, "layers": layers, "over_budget": False,
                             "max_rel_error": 0.0123},
                   "adacc_evolution": {"tracking_iterations": [1, 2], "switches": [],
                                       "outlier_channels": {"iterations": [1, 2], "ops": {"fc1": [3, 2]}}}}}
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "{" not in out and "[" not in out, out
    lines = out.splitlines()
    assert "    decisions             keep 40, compress:int4_outlier 12" in lines
    assert "    layers                4 entries, in --output-json" in lines
    assert "    over budget           no" in lines and "    max rel error         0.0123" in lines
    assert "    switches              none" in lines[lines.index("  adacc_evolution"):]
    assert max(len(line) for line in lines) <= 100


def test_deterministic_mode_reaches_megatron_core_s_config():
    """Megatron-LM's flag, for bit-exact runs: megatron-core's deterministic code paths (its config field), and
    Adacc's evolution switching on outlier statistics alone (tests/policy/test_evolution.py)."""
    import torch

    from megatron_adacc.training.model import transformer_config

    assert not transformer_config(parse_train_args(["--config", "tiny"]), torch.device("cpu")).deterministic_mode
    args = parse_train_args(["--config", "tiny", "--deterministic-mode"])
    assert args.deterministic_mode and transformer_config(args, torch.device("cpu")).deterministic_mode
