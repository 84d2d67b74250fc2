"""`adacc train` flags -> the ResiReduce extension."""

from __future__ import annotations

import pytest

from megatron_adacc.comm import build_extension
from megatron_adacc.comm.extension import ResiReduceExtension
from megatron_adacc.training.args import parse_train_args


def test_off_builds_nothing():
    assert build_extension(parse_train_args(["--resireduce", "off"])) is None


def test_flags_reach_the_extension():
    ext = build_extension(parse_train_args([
        "--resireduce", "w+2d", "--grad-compressor", "qsgd", "--qsgd-levels", "8", "--grad-compress-density",
        "0.05", "--resireduce-group-size", "3", "--resireduce-phi", "0.25", "--resireduce-ratio", "0.4",
        "--resireduce-transport", "reduce-scatter"]))
    assert isinstance(ext, ResiReduceExtension)
    assert (ext.scheme, ext.compressor_name) == ("w+2d", "qsgd")
    assert ext.options == dict(density=0.05, qsgd_levels=8, group_size=3, phi=0.25, ratio=0.4,
                               transport="reduce-scatter")


def test_checkpoint_of_another_rank_or_scheme_is_refused():
    ext = ResiReduceExtension("w")
    ext.attachment = object()  # stands in for setup(); load_state_dict checks before touching it
    with pytest.raises(ValueError, match="--resireduce a, not w"):
        ext.load_state_dict({"scheme": "a", "rank": 0, "world_size": 1})
    with pytest.raises(ValueError, match="per rank"):
        ext.load_state_dict({"scheme": "w", "rank": 1, "world_size": 2})


def test_one_process_says_that_nothing_is_communicated(capsys, adacc_log):
    """A world of one still compresses gradients (error feedback), which changes training: say so."""
    from megatron_adacc.training.loop import train

    train(parse_train_args(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
                            "--train-iters", "1", "--no-progress", "--resireduce", "w"]))
    err = capsys.readouterr().err
    assert err.count("[resireduce] one process: nothing is communicated") == 1
