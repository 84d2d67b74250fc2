"""The compressed reduce-scatter makes the host wait for the device nowhere (issue 24's rule, for issue 25's
transport): payload sizes come from layouts, never from values, and QSGD's and DGC's draws, the owners'
requantization included, stay on the gradients' device. A host-drawn noise in the owners' QSGD is counted as
2 host-to-device copies per reduction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adacc.testing import REPO_ROOT

WORKER = Path(__file__).with_name("syncs_worker.py")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["case"]: r for r in (json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines()
                                   if x.startswith("RESULT "))}


@pytest.mark.parametrize("case", [f"{c}:{s}" for c in ("topk", "dgc", "qsgd") for s in (0, 1)])
def test_a_reduction_through_the_reduce_scatter_adds_no_host_sync(results, case):
    assert results[case]["transport"] == "reduce-scatter"
    assert results[case]["syncs"] == 0, results[case]["described"]
