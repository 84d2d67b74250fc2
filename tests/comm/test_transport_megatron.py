"""The transports inside megatron-core DDP on 4 gloo ranks: the compressed reduce-scatter with and without
overlap, with the distributed optimizer, under every kind of compressor, and what auto chooses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_adacc.testing import torchrun_results

WORKER = Path(__file__).with_name("megatron_worker.py")
SPECS = ["off:topk:0", "residual:none:0:0:reduce-scatter", "residual:topk:0:0:reduce-scatter", "w+2d:qsgd:1",
         "residual:topk:1:1", "w:dgc:0:1", "a:topk:0"]
#: auto at 4 ranks: top-k's owners would return 4 payloads' entries (3.75 P against the all-gather's 3 P); QSGD's
#: one (1.5 P); the distributed optimizer needs no return (0.75 P).
TRANSPORTS = {"residual:topk:0:0:reduce-scatter": "reduce-scatter", "w+2d:qsgd:1": "reduce-scatter",
              "residual:topk:1:1": "reduce-scatter", "w:dgc:0:1": "reduce-scatter", "a:topk:0": "allgather"}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    out = torchrun_results(WORKER, SPECS, nproc=4, timeout=900)
    for spec, r in out.items():
        assert "error" not in r, (spec, r["error"])
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_replicas_stay_identical(results, spec):
    assert results[spec]["max_param_diff"] == 0.0
    assert all(math.isfinite(x) for x in results[spec]["losses"])


@pytest.mark.parametrize("spec", TRANSPORTS)
def test_each_batch_takes_its_transport(results, spec):
    r = results[spec]
    assert r["transport"] == TRANSPORTS[spec]
    assert r["residual_bytes"] == r["formula_bytes"]  # ResiReduce's schemes keep their memory formula
    owners = TRANSPORTS[spec] == "reduce-scatter" and spec.split(":")[3:4] != ["1"]
    # The owners keep 1 / 4 of the gradients, unless the distributed optimizer needs no second compression.
    assert r["owner_residual_bytes"] == (r["full_residual_bytes"] // 4 if owners else 0)


def test_identity_through_the_reduce_scatter_is_megatron_to_rounding(results):
    """Four ranks: the owner adds in rank order, gloo's ring in its own, so equal to float rounding only."""
    ours, megatron = results["residual:none:0:0:reduce-scatter"], results["off:topk:0"]
    assert ours["losses"] == pytest.approx(megatron["losses"], rel=1e-6)


def test_the_distributed_optimizer_halves_the_reduce_scatter(results):
    """(N - 1) / N P to the owners and nothing back, against (N - 1) / N (P + 4 P) (same payloads: top-k)."""
    sharded, full = results["residual:topk:1:1"], results["residual:topk:0:0:reduce-scatter"]
    assert sharded["bytes_sent"] * 4 < full["bytes_sent"] < sharded["bytes_sent"] * 6
