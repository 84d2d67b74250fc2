"""Build of the compiled codec kernels, ``megatron_adacc._C`` (package metadata lives in pyproject.toml).

* CPU kernels (``csrc/*.cpp``) always: -O3, OpenMP through ``at::parallel_for``,
  ``-ffp-contract=off`` so that no multiply-add is fused (the kernels must match the pure-torch reference
  bit for bit) and ``-fno-trapping-math``, which lets GCC vectorize the clamps and selects without
  changing any result (only floating-point exception flags, which nothing reads). On x86-64 with GCC the
  loops are also compiled for AVX2+FMA+F16C and that variant is picked at run time when the CPU has it.
* CUDA kernels (``csrc/cuda/*.cu``) when a CUDA toolkit and a CUDA-enabled torch are both present.
  ``TORCH_CUDA_ARCH_LIST`` defaults to V100/A100/H100 (``7.0;8.0;9.0``); nvcc 13 dropped sm_70, so with
  nvcc >= 13 the default is ``8.0;9.0``.

Environment: ``ADACC_BUILD_CUDA=0`` forces a CPU-only build, ``=1`` fails loudly when CUDA is not usable.
Build with ``pip install --no-build-isolation -e .`` (isolation would fetch a fresh multi-GB torch).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _torch_build_helpers():
    try:
        from torch.utils import cpp_extension
    except ImportError:
        sys.exit(
            "megatron-adacc: building the codec extension needs torch in the build environment; install torch "
            "first and build with `pip install --no-build-isolation -e .`"
        )
    return cpp_extension


def _nvcc_version(cuda_home: str) -> tuple[int, int] | None:
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _want_cuda(cpp_extension) -> bool:
    import torch

    setting = os.environ.get("ADACC_BUILD_CUDA", "auto").lower()
    usable = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if setting in ("0", "false", "no"):
        return False
    if setting in ("1", "true", "yes") and not usable:
        sys.exit(
            "ADACC_BUILD_CUDA=1 but CUDA kernels cannot be built: "
            f"torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={cpp_extension.CUDA_HOME!r}. Install a "
            "CUDA-enabled torch and a CUDA toolkit (or set CUDA_HOME)."
        )
    return usable


def _default_arch_list(cuda_home: str) -> str:
    version = _nvcc_version(cuda_home)
    if version is not None and version[0] >= 13:
        return "8.0;9.0"  # CUDA 13 no longer targets sm_70
    return "7.0;8.0;9.0"


def extensions() -> list:
    cpp_extension = _torch_build_helpers()
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
    cxx = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
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


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": _torch_build_helpers().BuildExtension.with_options(use_ninja=True),
              "build_py": BuildPyWithConfigs},
)
