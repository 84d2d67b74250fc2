"""Which implementation runs: the compiled extension must be the one in use when ADACC_REQUIRE_EXT=1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from codec_test_utils import EXT

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, cwd=ROOT,
        timeout=120,
    )


@pytest.mark.skipif(
    EXT is None and os.environ.get("ADACC_REQUIRE_EXT") != "1", reason="megatron_adacc._C not built"
)
def test_compiled_cpu_extension_is_in_use_when_required():
    result = _run(
        """
        import torch
        from megatron_adacc import codecs
        from megatron_adacc.codecs import _backend
        print(codecs.backend(), codecs.backend("cpu"), _backend._C.__file__)
        # Poison the reference: if any kernel call fell back to it, compress would raise.
        from megatron_adacc.codecs import reference
        def poisoned(*args):
            raise AssertionError("reference kernel used")
        reference.sym_int4_compress = poisoned
        p = codecs.get_codec("int4_symmetric").compress(torch.randn(4, 8))
        print("compiled-path-ok", type(_backend._C.sym_int4_compress).__name__)
        """,
        ADACC_REQUIRE_EXT="1",
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()[:2]
    backend, backend_cpu, path = first.split()
    assert backend_cpu == "cpp"
    assert backend in ("cpp", "cuda")
    assert "megatron_adacc" in path and path.endswith(".so")
    assert second.split() == ["compiled-path-ok", "builtin_function_or_method"]


def test_missing_extension_is_an_error_when_required():
    code = """
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "megatron_adacc._C":
                    raise ImportError("simulated missing extension")
        sys.meta_path.insert(0, Block())
        import megatron_adacc.codecs
        """
    required = _run(code, ADACC_REQUIRE_EXT="1")
    assert required.returncode != 0
    assert "ADACC_REQUIRE_EXT=1" in required.stderr and "pip install --no-build-isolation" in required.stderr
    optional = _run(code + "print(megatron_adacc.codecs.backend())", ADACC_REQUIRE_EXT="0")
    assert optional.returncode == 0, optional.stderr
    assert optional.stdout.strip() == "reference" and "slower pure-torch reference" in optional.stderr
