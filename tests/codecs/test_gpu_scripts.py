"""The scripts around the CUDA kernels, checked without a GPU: the architecture check that CI's compile check
and the Docker build share (scripts/check_cuda_arches.sh) passes only when cuobjdump lists machine code for
every architecture asked for, V100's sm_70 included; the GPU acceptance run refuses, in one line, to run
without a GPU, and with one (faked here) runs every step, the sync-debug training steps included."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "check_cuda_arches.sh"


@pytest.fixture
def fake_cuobjdump(tmp_path) -> Path:
    """A cuobjdump that lists the ELF images named, one per line, in the file it is given."""
    tool = tmp_path / "cuobjdump"
    tool.write_text('#!/bin/sh\n[ "$1" = --list-elf ] || exit 2\nn=0\nwhile read -r elf; do n=$((n + 1)); '
                    'echo "ELF file    $n: $elf"; done < "$2"\n')
    tool.chmod(0o755)
    return tool


def _check(arches: str, tool: Path, *listings: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), arches, *map(str, listings)], capture_output=True, text=True,
                          env={**os.environ, "CUOBJDUMP": str(tool)}, timeout=60)


def test_every_arch_present_across_files_passes(tmp_path, fake_cuobjdump):
    nvcc_object, clang_cubin = tmp_path / "codecs_cuda.o", tmp_path / "codecs_cuda.cubin"
    nvcc_object.write_text("codecs_cuda.1.sm_80.cubin\ncodecs_cuda.2.sm_90.cubin\n")
    clang_cubin.write_text("codecs_cuda.sm_70.cubin\n")
    result = _check("7.0;8.0;9.0", fake_cuobjdump, nvcc_object, clang_cubin)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout.splitlines()[-1]


def test_a_missing_arch_fails_and_is_named(tmp_path, fake_cuobjdump):
    so = tmp_path / "_C.so"
    so.write_text("_C.1.sm_80.cubin\n_C.2.sm_90.cubin\n_C.3.sm_75.cubin\n")  # sm_75 must not pass for sm_70
    result = _check("7.0;8.0;9.0", fake_cuobjdump, so)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("check_cuda_arches: no sm_70 machine code")
    assert _check("8.0;9.0", fake_cuobjdump, so).returncode == 0


def test_compile_check_asks_for_v100_a100_h100_by_default():
    text = (REPO / "scripts" / "check_cuda_compile.sh").read_text()
    assert 'arch_list="${TORCH_CUDA_ARCH_LIST:-7.0;8.0;9.0}"' in text
    assert 'scripts/check_cuda_arches.sh" "$arch_list"' in text


def test_gpu_acceptance_without_a_gpu_fails_in_one_line(tmp_path):
    # An nvidia-smi that lists no device stands for a machine without a GPU (the real one may be on PATH).
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_acceptance.sh")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["gpu_acceptance: no GPU: nvidia-smi lists no device"]
    assert not (tmp_path / "out").exists()


def _fake_gpu(tmp_path, python_script: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the acceptance script on a faked GPU machine: nvidia-smi lists an H100, and ``python_script`` is the
    shell body of the Python the script runs every step with. Returns the run and the results folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in *driver_version*) echo "550.54, 81559 MiB, 9.0" ;; '
                   '*) echo "NVIDIA H100 80GB HBM3" ;; esac\n')
    python = bin_dir / "python"
    python.write_text("#!/bin/sh\n" + python_script)
    for tool in (smi, python):
        tool.chmod(0o755)
    out = tmp_path / "out"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(python), "OUT": str(out),
                **env}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_acceptance.sh")], capture_output=True, text=True,
                            env=full_env, timeout=120)
    return result, out


def test_gpu_acceptance_runs_every_step_on_a_gpu_and_records_each(tmp_path):
    # The Python answers that CUDA is there, records how it was called, and succeeds.
    calls = tmp_path / "calls.txt"
    result, out = _fake_gpu(tmp_path, f'echo "ADACC_TEST_DEVICE=${{ADACC_TEST_DEVICE:-}} $*" >> "{calls}"\n'
                            'case "$*" in *get_device_capability*) echo 9.0 ;; esac\nexit 0\n',
                            MEGATRON_DIR=str(tmp_path / "no-megatron"))
    assert result.returncode == 1, result.stderr  # the smoke run has no Megatron-LM here
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0] == "device: NVIDIA H100 80GB HBM3"
    steps = {line.split()[0]: line.split()[1] for line in summary if line.endswith(".log")}
    assert steps == {"build": "ok", "codec-tests": "ok", "exact-tests": "ok", "sdpa-check": "ok",
                     "sdpa-check-bf16": "ok", "sync-debug": "ok", "bench-codecs": "ok", "bench-budget": "ok",
                     "megatron-smoke": "FAIL(3)"}
    sync_debug = [c for c in calls.read_text().splitlines() if "tests/gpu_ready/test_host_syncs.py" in c]
    assert len(sync_debug) == 1
    assert sync_debug[0].startswith("ADACC_TEST_DEVICE=cuda -m pytest") and "-k on_a_gpu" in sync_debug[0]


def test_gpu_acceptance_runs_the_steps_a_short_lease_names(tmp_path):
    """STEPS names the steps to run (the others are listed as skipped) and STEP_TIMEOUT_S bounds each."""
    result, out = _fake_gpu(tmp_path, 'case "$*" in *get_device_capability*) echo 9.0 ;; '
                            '*bench*codecs*) sleep 30 ;; esac\nexit 0\n',
                            STEPS="build sync-debug bench-codecs", STEP_TIMEOUT_S="2")
    assert result.returncode == 1, result.stderr  # bench-codecs ran out of time
    steps = {line.split()[0]: line.split()[1] for line in (out / "summary.txt").read_text().splitlines()[5:]}
    assert steps == {"build": "ok", "codec-tests": "skipped", "exact-tests": "skipped", "sdpa-check": "skipped",
                     "sdpa-check-bf16": "skipped", "sync-debug": "ok", "bench-codecs": "FAIL(124)",
                     "bench-budget": "skipped", "megatron-smoke": "skipped"}
