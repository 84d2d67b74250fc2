"""A process's peak memory is its own, whoever started it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_adacc.core import devices

MiB = 2**20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the carried-over peak is Linux's")


def test_a_child_of_a_large_process_reports_its_own_peak():
    """``ru_maxrss`` survives ``exec``: a small child of a large parent reported the parent's peak. A suite's
    test worker (600 MiB) lent it to the ``adacc train`` it launched, which then ran 90 MiB over its budget
    against a stock peak that was the worker's own."""
    ballast = bytearray(400 * MiB)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # resident, not only reserved
    code = ("import torch; from megatron_adacc.core import devices; "
            "print(devices.peak_memory_bytes(torch.device('cpu')))")
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert devices.peak_resident_bytes() >= 400 * MiB
    assert child < devices.peak_resident_bytes() - 200 * MiB, child / MiB
    del ballast


def test_the_peak_follows_a_touched_block():
    resident = devices.resident_bytes()
    block = torch.ones(64 * MiB // 4)  # 64 MiB, written
    assert devices.peak_resident_bytes() >= resident + 60 * MiB
    assert devices.peak_memory_bytes(torch.device("cpu")) >= devices.peak_resident_bytes()
    del block
