"""A rank that stops answering ends a 2-rank ``torchrun ... adacc train`` with one line naming it and a non-zero
exit, within ``--distributed-timeout-minutes`` and a short grace, instead of hanging forever."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_adacc.testing import REPO_ROOT, free_port

WORKER = Path(__file__).with_name("frozen_rank_worker.py")
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
        "--no-progress"]
#: Short, yet beyond a live rank's step on two loaded cores: at 3 s a collective of step 1 once timed out on a
#: rank that was slow, not stopped (the main suite beside other jobs).
TIMEOUT_S = 6
#: From the moment rank 1 stops to the line naming it: the timeout and the grace in which live ranks say so.
BOUND_S = 30
#: Start-up of two ranks on two shared cores (~20 s, over 45 s on a loaded machine) before rank 1 stops.
START_S = 90
#: torchrun's line as it tears the job down after rank 0 failed.
CLOSING = re.compile(r"Sending process (\d+) closing signal SIGTERM")


def _ranks(launcher: int) -> set[int]:
    """The launcher's children: torchrun starts each rank in a session of its own."""
    with contextlib.suppress(OSError):
        return {int(pid) for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()}
    return set()


def _kill(launcher: subprocess.Popen, ranks: set[int]) -> None:
    """torchrun and its ranks: a stopped rank left behind would stay stopped forever."""
    ranks = ranks | _ranks(launcher.pid)
    launcher.kill()
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run(cmd: list[str], env: dict) -> tuple[subprocess.Popen, list[str], float | None]:
    """Run torchrun; once it sends the stopped rank SIGTERM, SIGCONT that rank so that it dies now: torchrun
    otherwise waits a fixed 30 s before its SIGKILL, which is torchrun's teardown, not what is tested here.
    Returns the finished launcher, its output lines and the wall-clock time at which a line named a silent rank."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    ranks, lines, named_at = set(), [], None
    watchdog = threading.Timer(START_S + BOUND_S, lambda: _kill(proc, ranks))  # a hang ends the output, and the test
    watchdog.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            ranks |= _ranks(proc.pid)
            if named_at is None and "did not answer" in line:
                named_at = time.time()
            if (match := CLOSING.search(line)) and int(match.group(1)) in ranks:
                os.kill(int(match.group(1)), signal.SIGCONT)
        proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # the test failed half-way: its ranks are still torchrun's children
            _kill(proc, ranks)
            proc.wait()
    return proc, lines, named_at


def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), *TINY,
           "--distributed-timeout-minutes", str(TIMEOUT_S / 60)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
           "FROZEN_RANK_READY_DIR": str(tmp_path)}
    proc, lines, named_at = _run(cmd, env)
    named = [line for line in lines if "did not answer" in line]
    assert named and named[0].startswith(f"adacc: rank 1 of 2 did not answer for {TIMEOUT_S} s"), "".join(lines)[-3000:]
    assert "--distributed-timeout-minutes" in named[0]
    stopped = (tmp_path / "stopped").stat().st_mtime
    assert proc.returncode != 0 and named_at - stopped < BOUND_S, (proc.returncode, named_at - stopped)


def test_the_line_names_every_silent_rank_or_says_that_none_was():
    from datetime import timedelta

    from megatron_adacc.training.distributed import _message

    assert _message([1, 3], 4, timedelta(seconds=6)).startswith(
        "ranks 1, 3 of 4 did not answer for 6 s (--distributed-timeout-minutes 0.1)")
    assert _message([], 4, timedelta(minutes=10)).startswith("every rank waited 600 s")
