"""`adacc train --adacc-policy ...` in process: the extension installs the policy, training matches stock
Megatron where the policy is exact, and the reported bytes add up."""

from megatron_adacc.adacc.integration import dispatch as glue
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "2",
         "--no-progress"]


def test_keep_and_recompute_match_stock_and_report_memory():
    stock = train(parse_train_args(SMALL))
    keep = train(parse_train_args(SMALL + ["--adacc-policy", "keep"]))
    recompute = train(parse_train_args(SMALL + ["--adacc-policy", "recompute"]))
    assert keep["losses"] == stock["losses"] == recompute["losses"]
    # With every op kept, the bytes held for backward are exactly what stock Megatron holds.
    assert keep["saved_activation_bytes"] == stock["saved_activation_bytes"]
    report = recompute["extensions"]["adacc"]
    assert report["policy"] == "recompute" and report["max_rel_error"] == 0.0
    assert report["layer_bytes_measured"] == report["layer_bytes_predicted"]
    assert recompute["saved_activation_bytes"] < 0.5 * stock["saved_activation_bytes"]
    assert glue.is_installed()  # the extension leaves the policy on; the autouse fixture uninstalls it
