"""ResiReduce as a torch DDP communication hook: 2 gloo ranks under torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_adacc.testing import run_torchrun

WORKER = Path(__file__).with_name("ddp_hook_worker.py")
SPECS = ["default", "residual:none", "residual:topk", "a:topk", "w:dgc", "2d:topk", "w+2d:qsgd"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    proc = run_torchrun(WORKER, nproc=2, args=SPECS, timeout=300)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["spec"]] = r
    assert sorted(out) == sorted(SPECS), proc.stdout[-3000:]
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_replicas_stay_identical(results, spec):
    assert results[spec]["max_param_diff"] == 0.0


def test_identity_compressor_matches_ddp_default(results):
    assert results["residual:none"]["losses"] == results["default"]["losses"]
    assert results["residual:none"]["param_sha256"] == results["default"]["param_sha256"]


def test_reduced_residuals_are_smaller(results):
    full = results["residual:topk"]["residual_bytes"]
    assert full == results["residual:topk"]["full_bytes"]
    for spec in ("a:topk", "w:dgc", "2d:topk", "w+2d:qsgd"):
        assert results[spec]["residual_bytes"] < full, spec
    assert 0 < results["residual:topk"]["bytes_sent"]
