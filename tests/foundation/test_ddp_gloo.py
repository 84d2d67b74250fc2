"""Megatron DDP and optimizer over gloo with two ranks keep parameters identical."""

from pathlib import Path

import pytest

from megatron_adacc.testing import run_torchrun

SCRIPT = Path(__file__).parents[1] / "scripts" / "ddp_train.py"
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
        "--no-progress"]


@pytest.mark.parametrize("extra", [[], ["--overlap-grad-reduce"], ["--use-distributed-optimizer"]],
                         ids=["allreduce", "overlap", "distopt"])
def test_two_rank_ddp_keeps_params_identical(extra):
    proc = run_torchrun(SCRIPT, nproc=2, args=ARGS + extra)
    assert "PARAMS_IDENTICAL=True LOSS_MOVED=True WORLD=2" in proc.stdout
