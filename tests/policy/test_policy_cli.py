"""The ``adacc`` command line: its own flags, the policy commands' help and flag names, sizes kept in policy files,
and ``adacc show``'s per-layer totals. Nothing here profiles a model (``--analytic`` or hand-made files)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_adacc import __version__, cli
from megatron_adacc.adacc.policy import Decision, Policy, load_policy, save_policy
from megatron_adacc.adacc.policy.io import PolicySchemaError, policy_from_json, policy_to_json
from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS
from megatron_adacc.adacc.policy.profile import analytic_profile
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.adacc.policy.solver import op_costs
from megatron_adacc.core.tables import WIDTH

SMALL = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--ffn-hidden-size", "256", "--seq-length", "32", "--micro-batch-size", "2"]
SIG = plain_signature(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32, micro_batch_size=2,
                      dtype="float32", num_layers=2, megatron_core_version="0.16.1")


# ------------------------------------------------------------------------------------------ adacc itself
def test_version_and_no_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"adacc {__version__}"
    assert cli.main([]) == 2  # no command: a usage mistake, answered with the help on stderr
    err = capsys.readouterr().err
    assert err.startswith("usage: adacc") and "solve" in err and "-q, --quiet" in err


def test_quiet_leaves_the_results_and_drops_the_status_lines(tmp_path, capsys):
    argv = ["solve", "--analytic", *SMALL, "--adacc-memory-budget", "2GiB", "-o", str(tmp_path / "p.json")]
    assert cli.main(argv) == 0
    loud = capsys.readouterr()
    assert "[adacc] wrote" in loud.err and "per layer" in loud.out
    assert cli.main(["-q", *argv]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == loud.out


def test_megatron_lms_logging_level_is_honoured_unless_the_user_said_otherwise(tmp_path, capsys):
    argv = ["solve", "--analytic", *SMALL, "--adacc-memory-budget", "2GiB", "-o", str(tmp_path / "p.json")]
    assert cli.main([*argv, "--logging-level", "30"]) == 0
    assert "[adacc] wrote" not in capsys.readouterr().err
    assert cli.main(["-v", *argv, "--logging-level", "30"]) == 0  # -v given to adacc wins
    assert "[adacc] wrote" in capsys.readouterr().err
    assert cli.main([*argv, "--logging-level", "loud"]) == 2
    assert "--logging-level" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- the policy commands
@pytest.mark.parametrize("command, own", [("solve", ["--output", "--candidate-codecs", "--analytic"]),
                                          ("profile", ["--refresh", "--repeats"])])
def test_help_lists_the_commands_own_flags_first_and_only_the_training_flags_it_reads(command, own):
    out = subprocess.run([sys.executable, "-m", "megatron_adacc.cli", command, "--help"], capture_output=True,
                         text=True, timeout=120)
    text = out.stdout
    assert out.returncode == 0 and len(text.splitlines()) < 110, text  # was ~250 lines of training flags
    first_model_flag = text.index("  --config")
    assert all(0 < text.index(f"  {flag}") < first_model_flag for flag in own)
    assert "--num-layers N" not in text and "--train-iters" not in text and "--gact-level" not in text
    assert ("--adacc-memory-budget BYTES" in text) is (command == "solve")
    assert "--budget " not in text and "--adacc-codecs " not in text  # the deprecated spellings are hidden
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_one_budget_flag_and_the_old_spellings_still_work_with_a_note(tmp_path, capsys):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    assert cli.main(["solve", "--analytic", *SMALL, "--adacc-memory-budget", "60MiB", "-o", str(new),
                     "--candidate-codecs", "all"]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert cli.main(["solve", "--analytic", *SMALL, "--budget", "60MiB", "-o", str(old), "--adacc-codecs", "all"]) == 0
    err = capsys.readouterr().err
    assert "[adacc] WARNING: --budget is deprecated and will go: use --adacc-memory-budget" in err
    assert "--adacc-codecs is deprecated and will go: use --candidate-codecs" in err
    assert load_policy(old).layers == load_policy(new).layers and load_policy(old).budget_bytes == 60 * 2**20
    assert cli.main(["solve", "--analytic", *SMALL, "--budget", "0", "-o", str(old)]) == 2
    assert "--budget" in capsys.readouterr().err  # a bad value is refused under the name it was given


def test_the_budget_is_printed_in_the_units_it_was_given(tmp_path, capsys):
    assert cli.main(["solve", "--analytic", *SMALL, "--adacc-memory-budget", "60MB", "-o", str(tmp_path / "p")]) == 0
    assert "budget 60.00 MB," in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ sizes in files
def _policy_with_costs() -> Policy:
    """Two kinds of layers; ``dropout`` saves nothing (no dropout in this model), so ``adacc show`` hides it."""
    a = [Decision.keep() for _ in OPS]
    b = [Decision.recompute() if i == 2 else Decision.compress(OPS[i].default_codec) if i == 3 else Decision.keep()
         for i in range(len(OPS))]
    policy = Policy(layers=[list(a), list(b), list(b)], signature=dict(SIG, num_layers=3), budget_bytes=10**9,
                    profile={"db": "/nowhere/p.sqlite", "id": 1}, name="adacc")
    profile = analytic_profile(dict(SIG, num_layers=3))
    profile.op("dropout").saved_bytes = 0
    policy.op_costs = op_costs(profile, policy)
    return policy


def test_a_policy_file_keeps_each_ops_sizes_and_old_files_still_load(tmp_path):
    policy = _policy_with_costs()
    path = save_policy(policy, tmp_path / "p.json")
    again = load_policy(path)
    assert again.op_costs == policy.op_costs and set(again.op_costs) == set(OP_NAMES)
    softmax = again.op_costs[OPS[3].name]
    assert set(softmax["codecs"]) == {OPS[3].default_codec}  # only the codecs the policy uses
    saved, stored, time_s = again.decision_cost(OPS[3].name, again.layers[1][3])
    assert 0 < stored < saved and time_s > 0
    assert again.decision_cost(OPS[2].name, again.layers[1][2])[1] == 0  # recomputed: nothing stored
    old = policy_to_json(policy)
    del old["op_costs"]  # a file from before the sizes were kept
    assert policy_from_json(old).op_costs is None


@pytest.mark.parametrize("change, field", [
    (lambda c: c.update(frobnicate={}), "op_costs.frobnicate"),
    (lambda c: c["linear_qkv"].update(saved_bytes=-1), "op_costs.linear_qkv.saved_bytes"),
    (lambda c: c["linear_qkv"].update(recompute_time_s="fast"), "op_costs.linear_qkv.recompute_time_s"),
    (lambda c: c["softmax"]["codecs"].update(int4_asymmetric={"compressed_bytes": 1}),
     "op_costs.softmax.codecs.int4_asymmetric.time_s"),
])
def test_bad_sizes_in_a_file_are_refused_naming_the_field(change, field):
    obj = policy_to_json(_policy_with_costs())
    change(obj["op_costs"])
    with pytest.raises(PolicySchemaError) as exc:
        policy_from_json(obj)
    assert exc.value.field == field


def test_show_prints_sizes_from_the_file_per_layer_totals_and_hides_what_saves_nothing(tmp_path, capsys):
    path = save_policy(_policy_with_costs(), tmp_path / "p.json")  # its profile database is not here
    assert cli.main(["show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("dropout ") for line in lines)
    assert any(line.startswith("not listed, as they save nothing for backward") and "dropout" in line
               for line in lines)
    assert [line.split()[0] for line in lines if line.startswith(("per layer", "x 2 layers"))] == \
        ["per", "per", "x"]  # one total per group, and the group of two layers' sum
    assert any(line.startswith("all 3 layers: ") for line in lines)
    assert not any(" - " in f" {line} " for line in lines if line.startswith("linear_qkv"))
    assert max(len(line) for line in lines) <= WIDTH
    assert cli.main(["show", str(path), "--all-ops"]) == 0
    assert any(line.startswith("dropout ") for line in capsys.readouterr().out.splitlines())


def test_show_says_when_a_file_has_no_sizes_and_no_profile(tmp_path, capsys):
    obj = policy_to_json(_policy_with_costs())
    del obj["op_costs"]
    (tmp_path / "old.json").write_text(json.dumps(obj))
    assert cli.main(["show", str(tmp_path / "old.json")]) == 0
    out = capsys.readouterr().out
    assert "sizes unknown" in out and "`adacc solve` again writes them" in out
