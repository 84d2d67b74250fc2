"""Against a real, patched Megatron-LM checkout, when ``MEGATRON_LM_DIR`` points at one (skipped otherwise).

Runs Megatron-LM's own ``parse_and_validate_args`` with our provider and then ``configure()`` in a subprocess
(``scripts/megatron_lm_cpu_check.py``): CPU only, nothing is trained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")

pytestmark = [
    pytest.mark.skipif(not MEGATRON_LM_DIR, reason="set MEGATRON_LM_DIR to a patched Megatron-LM checkout"),
    pytest.mark.slow,
]


def check(*flags: str) -> dict:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "megatron_lm_cpu_check.py"), MEGATRON_LM_DIR,
                          *flags], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_none_wraps_nothing():
    result = check("--adacc-policy", "none")
    assert result["session"] is None and result["wrapped"] == []


def test_feature_flags_parse_and_wrap_the_training_loop():
    result = check("--resireduce", "w", "--grad-compressor", "dgc", "--grad-compress-density", "0.05")
    assert result["parsed"]["resireduce"] == "w" and result["session"] == ["resireduce"]
    assert result["wrapped"] == ["megatron.training.training.setup_model_and_optimizer",
                                 "megatron.training.training.train_step"]


def test_adama_also_replaces_ddp_and_the_optimizer():
    result = check("--adama", "--clip-grad", "0", "--no-gradient-accumulation-fusion")
    assert "megatron.training.models.dist_utils._ddp_wrap" in result["wrapped"]
    assert "megatron.training.training.get_megatron_optimizer" in result["wrapped"]


def test_megatron_recompute_with_adacc_is_refused():
    result = check("--adacc-policy", "auto", "--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "1")
    assert "drop --recompute-granularity" in result["refused"]
