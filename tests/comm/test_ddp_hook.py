"""ResiReduce as a torch DDP communication hook: 2 gloo ranks under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_adacc.testing import torchrun_results

WORKER = Path(__file__).with_name("ddp_hook_worker.py")
SPECS = ["default", "residual:none", "residual:topk", "a:topk", "w:dgc", "2d:topk", "w+2d:qsgd",
         "residual:none:reduce-scatter", "w:topk:reduce-scatter"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return torchrun_results(WORKER, SPECS, timeout=300)


@pytest.mark.parametrize("spec", SPECS)
def test_replicas_stay_identical(results, spec):
    assert results[spec]["max_param_diff"] == 0.0


@pytest.mark.parametrize("spec", ["residual:none", "residual:none:reduce-scatter"])
def test_identity_compressor_matches_ddp_default(results, spec):
    assert results[spec]["losses"] == results["default"]["losses"]
    assert results[spec]["param_sha256"] == results["default"]["param_sha256"]


def test_the_hook_takes_the_transport_asked_for(results):
    assert results["residual:topk"]["transports"] == ["allgather"]  # auto, at 2 ranks
    assert results["w:topk:reduce-scatter"]["transports"] == ["reduce-scatter"]


def test_reduced_residuals_are_smaller(results):
    full = results["residual:topk"]["residual_bytes"]
    assert full == results["residual:topk"]["full_bytes"]
    for spec in ("a:topk", "w:dgc", "2d:topk", "w+2d:qsgd"):
        assert results[spec]["residual_bytes"] < full, spec
    assert 0 < results["residual:topk"]["bytes_sent"]
