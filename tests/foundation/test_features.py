"""`adacc train --adacc-policy auto`: profile, solve and evolution join the loop; bad budgets stop early."""

import pytest

from megatron_adacc.adacc.policy.strategies.base import InfeasibleBudgetError
from megatron_adacc.core.errors import AdaccError
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "4", "--no-progress"]


@pytest.fixture(autouse=True)
def _uninstall(monkeypatch, tmp_path):
    monkeypatch.setenv("ADACC_PROFILE_DB", str(tmp_path / "profile.sqlite"))
    yield
    from megatron_adacc.adacc.integration import uninstall

    uninstall()


def test_auto_policy_trains_with_evolution():
    """Under a budget that keeps it from keeping everything: a policy keeping everything starts no evolution."""
    auto = SMALL + ["--adacc-policy", "auto", "--train-iters", "4"]  # the same command, as a user reruns it:
    with pytest.raises(InfeasibleBudgetError) as refusal:  # its process memory is calibrated over its 4 steps
        train(parse_train_args(auto + ["--adacc-memory-budget", "1MiB"]))
    budget = refusal.value.min_feasible_bytes + 2**16  # activations here are a few hundred KiB a layer
    summary = train(parse_train_args(auto + ["--adacc-memory-budget", str(budget)]))
    assert set(summary["extensions"]["adacc"]["decisions"]) != {"keep"}
    evolution = summary["extensions"]["adacc_evolution"]
    assert evolution["tracking_iterations"] == [1, 2, 4]
    # every op offering outlier-separated INT4 was sampled on each tracking iteration, whatever its decision
    from megatron_adacc.adacc.integration.outlier_probe import OUTLIER_OPS

    series = evolution["outlier_channels"]
    assert series["iterations"] == [1, 2, 4] and set(series["ops"]) == set(OUTLIER_OPS)
    assert all(len(v) == 3 and None not in v for v in series["ops"].values())
    assert summary["final_loss"] < summary["first_loss"]


def test_infeasible_budget_names_the_smallest_feasible_one():
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget is"):
        train(parse_train_args(SMALL + ["--train-iters", "1", "--adacc-policy", "auto",
                                        "--adacc-memory-budget", "1MiB"]))


def test_adacc_and_megatron_recompute_are_exclusive():
    with pytest.raises(AdaccError, match="--recompute-granularity"):
        train(parse_train_args(SMALL + ["--adacc-policy", "keep", "--recompute-granularity", "full",
                                        "--recompute-method", "uniform", "--recompute-num-layers", "1"]))


def test_a_missing_policy_file_is_one_line_and_exit_2(capsys, tmp_path):
    from megatron_adacc import cli

    assert cli.main(["train", "--adacc-policy", str(tmp_path / "nope.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("adacc: --adacc-policy") and "make one with `adacc solve`" in err[-1]
    assert not any(line.startswith("Traceback") for line in err)


@pytest.mark.parametrize("flags, named", [
    (["--gact-bits", "2"], "--gact-bits configures gact, which is off: turn it on with --gact-level"),
    (["--adacc-memory-budget", "1GiB", "--adacc-outlier-z=2"],
     "--adacc-memory-budget, --adacc-outlier-z configure adacc, which is off: turn it on with --adacc-policy"),
    (["--resireduce-ratio", "0.1"], "--resireduce-ratio configures resireduce"),
])
def test_a_flag_of_a_feature_left_off_is_refused(flags, named):
    """It would do nothing, and whoever wrote it believes the feature is on."""
    with pytest.raises(AdaccError, match=named):
        parse_train_args(SMALL + flags)
    parse_train_args(SMALL + flags, feature_flags_need_feature=False)  # the policy tools read Adacc's flags


def test_a_feature_on_takes_its_flags():
    args = parse_train_args(SMALL + ["--gact-level", "L1", "--gact-bits", "2", "--adacc-policy", "none"])
    assert args.gact_bits == 2
