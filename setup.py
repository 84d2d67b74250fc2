"""Build of the compiled codec kernels, ``megatron_adacc._C`` (package metadata lives in pyproject.toml).

* CPU kernels (``csrc/*.cpp``) always: -O3, OpenMP through ``at::parallel_for``,
  ``-ffp-contract=off`` so that no multiply-add is fused (the kernels must match the pure-torch reference
  bit for bit) and ``-fno-trapping-math``, which lets GCC vectorize the clamps and selects without
  changing any result (only floating-point exception flags, which nothing reads). On x86-64 with GCC the
  loops are also compiled for AVX2+FMA+F16C and that variant is picked at run time when the CPU has it.
  ``-g0`` overrides the ``-g`` of Python's own CFLAGS: debug information for the kernels' many template
  instances doubled the compile time (three builds in CI: the checkout, the wheel, Python 3.12) and the
  library's size.
* CUDA kernels (``csrc/cuda/*.cu``) when they can be built and run here: a CUDA-enabled torch, a CUDA toolkit
  of torch's CUDA major version with its runtime library (an ``nvcc`` on PATH alone is not a toolkit) and a
  visible GPU. Otherwise the CPU extension is built, with a warning when torch could have used CUDA.
  ``TORCH_CUDA_ARCH_LIST`` defaults to V100/A100/H100 (``7.0;8.0;9.0``); nvcc 13 dropped sm_70, so with
  nvcc >= 13 the default is ``8.0;9.0``.

Environment: ``ADACC_BUILD_CUDA=0`` forces a CPU-only build; ``=1`` builds the CUDA kernels even without a GPU
(a container build) and fails loudly when the toolkit is not usable.

torch is deliberately not a build requirement: pip would download a second, multi-GB CUDA torch into the
isolated build environment and compile against it. ``pip install .`` builds against the torch already
installed (``build_backend/adacc_build_backend.py`` finds it); without one the build stops, saying so. The
sdist needs no torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


NO_TORCH = (
    "megatron-adacc: the compiled codecs are built against the torch they will run with, and this build "
    "environment has none. Install torch first (pip install torch), then pip install . -- a build in a separate "
    "environment (python -m build, uv) needs torch there: python -m build --no-isolation, or "
    "uv pip install --no-build-isolation ."
)


def _torch_build_helpers():
    """torch's extension helpers, or None when torch is not installed (an sdist needs none)."""
    try:
        from torch.utils import cpp_extension
    except ImportError:
        return None
    return cpp_extension


def _nvcc_version(cuda_home: str) -> tuple[int, int] | None:
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cuda_problem(cpp_extension) -> str | None:
    """Why the CUDA kernels cannot be built here, or None. torch takes CUDA_HOME from the ``nvcc`` on PATH when
    the variable is unset, and a wrapper script there made it pick a folder with no runtime library: the
    build then compiled for minutes and failed at link, so the toolkit is checked before anything compiles."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    home = cpp_extension.CUDA_HOME
    if home is None:
        return "no CUDA toolkit found (set CUDA_HOME)"
    nvcc = _nvcc_version(home)
    if nvcc is None:
        return f"CUDA_HOME={home} has no working bin/nvcc"
    if str(nvcc[0]) != torch.version.cuda.split(".")[0]:
        return f"nvcc {nvcc[0]}.{nvcc[1]} in {home} is not torch's CUDA {torch.version.cuda}"
    runtime = ("lib64/libcudart.so*", "lib/libcudart.so*", "lib/x64/cudart.lib")
    if not any(any(Path(home).glob(pattern)) for pattern in runtime):
        return f"CUDA_HOME={home} has no CUDA runtime library (set CUDA_HOME to the toolkit, e.g. /usr/local/cuda)"
    return None


def _want_cuda(cpp_extension) -> bool:
    """Whether to build the CUDA kernels (see the module docstring)."""
    import torch

    setting = os.environ.get("ADACC_BUILD_CUDA", "auto").strip().lower()
    if setting not in ("auto", "", "0", "1", "false", "true", "no", "yes", "off", "on"):
        sys.exit(f"ADACC_BUILD_CUDA={setting!r}: use 0 (CPU kernels only), 1 (CUDA kernels too) or auto")
    if setting in ("0", "false", "no", "off"):
        return False
    problem = _cuda_problem(cpp_extension)
    if setting in ("1", "true", "yes", "on"):
        if problem:
            sys.exit(f"ADACC_BUILD_CUDA=1 but the CUDA kernels cannot be built: {problem}.")
        return True
    if problem is None and not torch.cuda.is_available():
        problem = "no GPU is visible (ADACC_BUILD_CUDA=1 builds them anyway, e.g. for a container)"
    if problem and torch.version.cuda is not None:
        print(f"megatron-adacc: building the CPU kernels only: {problem}", file=sys.stderr)
    return problem is None


def _default_arch_list(cuda_home: str) -> str:
    version = _nvcc_version(cuda_home)
    if version is not None and version[0] >= 13:
        return "8.0;9.0"  # CUDA 13 no longer targets sm_70
    return "7.0;8.0;9.0"


def extensions(cpp_extension) -> list:
    """The extension to build; without torch, a placeholder that lists the sources for the sdist."""
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
    if cpp_extension is None:
        return [Extension("megatron_adacc._C", sources)]
    cxx = ["-O3", "-g0", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
    link = ["-fopenmp"]
    if sys.platform == "darwin":  # Apple clang has no -fopenmp; at::parallel_for then runs serially
        cxx.remove("-fopenmp")
        link = []
    if _want_cuda(cpp_extension):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list(cpp_extension.CUDA_HOME))
        sources += sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cuda").glob("*.cu"))
        nvcc = ["-O3", "--fmad=false", "-DADACC_WITH_CUDA"]
        ext = cpp_extension.CUDAExtension(
            "megatron_adacc._C",
            sources,
            include_dirs=[str(CSRC)],
            extra_compile_args={"cxx": cxx + ["-DADACC_WITH_CUDA"], "nvcc": nvcc},
            extra_link_args=link,
        )
    else:
        ext = cpp_extension.CppExtension(
            "megatron_adacc._C",
            sources,
            include_dirs=[str(CSRC)],
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    return [ext]


class BuildExtNeedsTorch(build_ext):
    """``build_ext`` where torch is missing: stop with what to do instead of a compiler error."""

    def run(self) -> None:
        sys.exit(NO_TORCH)


class BuildPyWithConfigs(build_py):
    """Also copy the top-level ``configs/*.toml`` into the built package as ``megatron_adacc/configs/``.

    A wheel holds only what is inside the package, and ``adacc train --config NAME`` must find the configs
    after ``pip install``; the checkout keeps them at the top level, where users look for them.
    ``megatron_adacc.core.config_files`` reads the package copy when there is one, else the checkout's.
    An editable install needs no copy: it runs from the checkout.
    """

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "megatron_adacc" / "configs"
        self.mkpath(str(target))
        for path in sorted((ROOT / "configs").glob("*.toml")):
            self.copy_file(str(path), str(target / path.name))


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    _CPP_EXTENSION = _torch_build_helpers()
    setup(
        ext_modules=extensions(_CPP_EXTENSION),
        cmdclass={"build_ext": _CPP_EXTENSION.BuildExtension.with_options(use_ninja=True) if _CPP_EXTENSION
                  else BuildExtNeedsTorch,
                  "build_py": BuildPyWithConfigs},
    )
