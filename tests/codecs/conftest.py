"""Shared fixtures of the codec tests: the compiled CPU variants to compare against the reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The shared helpers (codec_test_utils.py) import by name whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from codec_test_utils import EXT  # noqa: E402


def cpu_isas() -> list[str]:
    """The CPU kernel variants this build and CPU can run ('base' always; 'avx2' on x86-64 with AVX2)."""
    if EXT is None:
        return []
    isas = ["base"]
    try:
        EXT.set_cpu_isa("avx2")
        isas.append("avx2")
    except RuntimeError:
        pass
    finally:
        EXT.set_cpu_isa("auto")
    return isas


@pytest.fixture(params=cpu_isas() or [pytest.param("none", marks=pytest.mark.skip("megatron_adacc._C not built"))])
def isa(request):
    """Run the test once per compiled CPU variant, restoring automatic selection afterwards."""
    EXT.set_cpu_isa(request.param)
    yield request.param
    EXT.set_cpu_isa("auto")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device of the device-parametrized kernel tests: ``ADACC_TEST_DEVICE`` (default ``cpu``).

    A device asked for must be there and run compiled kernels: the GPU acceptance run sets
    ``ADACC_TEST_DEVICE=cuda``, and a skip would let it pass without a GPU or without the CUDA kernels."""
    dev = torch.device(os.environ.get("ADACC_TEST_DEVICE", "cpu"))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            pytest.fail("ADACC_TEST_DEVICE=cuda but torch sees no CUDA device", pytrace=False)
        if EXT is None or not EXT.with_cuda:
            pytest.fail("ADACC_TEST_DEVICE=cuda but megatron_adacc._C has no CUDA kernels (rebuild with "
                        "ADACC_BUILD_CUDA=1)", pytrace=False)
    elif dev.type != "cpu":
        pytest.fail(f"ADACC_TEST_DEVICE={dev} is neither cpu nor cuda", pytrace=False)
    elif EXT is None:
        pytest.skip("megatron_adacc._C not built")
    return dev


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(1234)
