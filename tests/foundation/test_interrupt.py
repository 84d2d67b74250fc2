"""Ctrl-C during ``adacc train``: the step under way finishes, a checkpoint is saved with --save, exit 130."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--no-progress"]


def test_sigint_finishes_the_step_saves_and_exits_130(tmp_path):
    manifest = tmp_path / "rank00000.json"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_adacc.cli", "train", *SMALL, "--train-iters", "100000",
                             "--save", str(tmp_path), "--save-interval", "1"], cwd=REPO, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 240
    while not manifest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert manifest.exists(), "training never saved its first checkpoint"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    saved = json.loads(manifest.read_text())["iteration"]
    assert f"adacc: interrupted after iteration {saved}; saved, resume with --load" in err
    assert "Traceback" not in err and saved < 100000
