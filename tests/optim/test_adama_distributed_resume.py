"""``adacc train --adama --use-distributed-optimizer`` at 2 gloo ranks resumes bit for bit from each rank's
shards, and refuses a checkpoint of another data-parallel size in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_adacc.testing import run_torchrun

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("adama-do-ckpt")
    proc = run_torchrun(HERE / "adama_resume_worker.py", nproc=2, args=[str(workdir)], timeout=900)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return workdir, json.loads(line[len("RESULT "):])


def test_resume_is_bit_exact(resumed):
    _, r = resumed
    assert r["first_two"] == r["straight"][:2]
    assert r["resumed"] == r["straight"][2:]  # iterations 3 and 4, bit for bit
    assert r["same_params"]
    # Each rank's checkpoint holds its own slices of m, v and the fp32 master weights ...
    assert r["saved_rank"] == 0 and r["saved_layout"]["dp_size"] == 2
    assert r["saved_keys"] == ["exp_avg", "exp_avg_sq", "master_param"]
    # ... and they are what makes it exact: a resume that leaves them fresh differs.
    assert r["without_shards"] != r["straight"][2:]


def test_another_data_parallel_size_is_refused(resumed):
    import sys

    from megatron_adacc.optim.distributed import ShardMismatch
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    workdir, _ = resumed
    sys.path.insert(0, str(HERE))
    from adama_resume_worker import COMMON

    with pytest.raises(ShardMismatch, match="data-parallel size 2 .* this run has 1"):
        train(parse_train_args(COMMON + ["--train-iters", "4", "--load", str(workdir), "--global-batch-size", "4"]))
