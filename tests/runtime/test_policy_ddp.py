"""Two data-parallel ranks (Megatron DDP over gloo) train under Adacc policies through `adacc train`."""

import json
from pathlib import Path

import pytest
from _runtime_helpers import decisions, policy_of

from megatron_adacc.adacc.policy.io import save_policy
from megatron_adacc.adacc.policy.policy import Decision
from megatron_adacc.testing import run_torchrun

WORKER = Path(__file__).with_name("ddp_policy_worker.py")
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
        "--no-progress"]


def _run(extra):
    proc = run_torchrun(WORKER, nproc=2, args=ARGS + extra, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _policy_file(tmp_path, layers, name):
    return str(save_policy(policy_of(layers, name=name), tmp_path / f"{name}.json"))


@pytest.fixture(scope="module")
def stock():
    return _run([])


def test_two_ranks_recompute_mix_is_exact(stock, tmp_path):
    """Keep/recompute mixes are exact rank by rank, through Megatron's DDP gradient hooks."""
    path = _policy_file(tmp_path, [decisions(recompute=("scores", "softmax", "dropout", "context")),
                                   decisions(recompute=("linear_fc1", "activation", "linear_fc2", "mlp_bda"))],
                        "ddp-exact")
    exact = _run(["--adacc-policy", path])
    assert stock["world"] == exact["world"] == 2
    assert stock["identical"] and exact["identical"]
    assert exact["losses"] == stock["losses"]
    assert exact["max_rel_error"] == 0.0


@pytest.mark.slow
def test_two_ranks_compressing_policy(stock, tmp_path):
    path = _policy_file(tmp_path, [
        decisions(recompute=("scores", "softmax", "dropout", "context"), compress={"activation": "int4_outlier"}),
        decisions(recompute=("linear_fc1", "activation"), compress={"linear_qkv": "int4_channelwise"}),
    ], "ddp-mixed")
    mixed = _run(["--adacc-policy", path])
    assert mixed["world"] == 2 and mixed["identical"]
    # Compression changes only backward: the first loss is exact; the trajectory stays close.
    assert mixed["losses"][0] == stock["losses"][0]
    assert all(abs(a - b) < 0.05 * b for a, b in zip(mixed["losses"], stock["losses"]))
    # The last step's batch differs from the profiled one: codec sizes move a little (outlier counts).
    assert mixed["max_rel_error"] <= 0.05


@pytest.mark.parametrize("overlap", [False, True])
def test_two_ranks_with_the_mlp_re_run_in_tiles(stock, tmp_path, overlap):
    """A tiled MLP hands its weight gradients to Megatron DDP's hooks once per backward, also with the gradient
    reduction overlapped (whose buckets count each parameter's hook): ranks stay identical, the trajectory
    matches to float rounding."""
    chosen = decisions(recompute=("input_layernorm", "linear_fc1", "activation", "linear_fc2"))
    chosen.update({name: Decision.recompute(4) for name in ("linear_fc1", "activation", "linear_fc2")})
    path = _policy_file(tmp_path, [chosen] * 2, "ddp-tiled")
    tiled = _run(["--adacc-policy", path] + (["--overlap-grad-reduce"] if overlap else []))
    assert tiled["world"] == 2 and tiled["identical"]
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(tiled["losses"], stock["losses"]))
