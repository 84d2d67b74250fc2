"""What `pip install .` builds and what the package declares: the CUDA decision of setup.py, the in-tree build
backend that finds the installed torch, the metadata bounds, and where an installed package reads and writes.
(The sdist -> wheel -> fresh environment round trip itself is scripts/ci_package_check.sh, `make test-package`.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def setup_py():
    """setup.py's helpers (it calls setup() only when run as a build script)."""
    return load(ROOT / "setup.py", "adacc_setup_py")


def fake_toolkit(tmp_path: Path, release: str, runtime: bool) -> Path:
    """A CUDA_HOME whose bin/nvcc reports ``release``, with or without lib64/libcudart.so."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    if runtime:
        (tmp_path / "lib64").mkdir()
        (tmp_path / "lib64" / "libcudart.so").write_text("")
    return tmp_path


class FakeCppExtension:
    def __init__(self, home):
        self.CUDA_HOME = None if home is None else str(home)


@pytest.fixture
def cuda_torch(monkeypatch):
    """torch as a CUDA 13.0 build sees itself, on a machine without a GPU."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ADACC_BUILD_CUDA", raising=False)


def test_a_cpu_torch_builds_the_cpu_kernels_quietly(setup_py, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv("ADACC_BUILD_CUDA", raising=False)
    assert "CPU build" in setup_py._cuda_problem(FakeCppExtension("/usr/local/cuda"))
    assert setup_py._want_cuda(FakeCppExtension("/usr/local/cuda")) is False
    assert capsys.readouterr().err == ""


def test_an_nvcc_without_its_runtime_library_is_no_toolkit(setup_py, cuda_torch, tmp_path, monkeypatch, capsys):
    """The issue's machine: nvcc on PATH in /usr/local/bin made torch pick CUDA_HOME=/usr/local, which has no
    libcudart; the build compiled for 11 minutes and failed at link. Now: the CPU kernels, with a warning."""
    home = fake_toolkit(tmp_path, "13.0", runtime=False)
    assert "no CUDA runtime library" in setup_py._cuda_problem(FakeCppExtension(home))
    assert setup_py._want_cuda(FakeCppExtension(home)) is False
    assert "building the CPU kernels only: CUDA_HOME=" in capsys.readouterr().err
    monkeypatch.setenv("ADACC_BUILD_CUDA", "1")
    with pytest.raises(SystemExit, match="ADACC_BUILD_CUDA=1 but the CUDA kernels cannot be built"):
        setup_py._want_cuda(FakeCppExtension(home))


def test_a_toolkit_of_another_major_version_is_refused(setup_py, cuda_torch, tmp_path):
    home = fake_toolkit(tmp_path, "12.4", runtime=True)
    assert setup_py._cuda_problem(FakeCppExtension(home)) == f"nvcc 12.4 in {home} is not torch's CUDA 13.0"


def test_a_usable_toolkit_builds_cuda_when_a_gpu_is_visible_or_when_asked(setup_py, cuda_torch, tmp_path, monkeypatch,
                                                                         capsys):
    ext = FakeCppExtension(fake_toolkit(tmp_path, "13.0", runtime=True))
    assert setup_py._cuda_problem(ext) is None
    assert setup_py._want_cuda(ext) is False  # no GPU here: CPU kernels, saying how to force CUDA
    assert "no GPU is visible (ADACC_BUILD_CUDA=1 builds them anyway" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert setup_py._want_cuda(ext) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ADACC_BUILD_CUDA", "1")
    assert setup_py._want_cuda(ext) is True
    monkeypatch.setenv("ADACC_BUILD_CUDA", "0")
    assert setup_py._want_cuda(ext) is False
    monkeypatch.setenv("ADACC_BUILD_CUDA", "maybe")
    with pytest.raises(SystemExit, match="use 0 .* 1 .* or auto"):
        setup_py._want_cuda(ext)


def test_without_torch_the_sdist_still_lists_the_sources_and_build_ext_says_what_to_do(setup_py):
    placeholder, = setup_py.extensions(None)
    assert sorted(placeholder.sources) == sorted(f"csrc/{p.name}" for p in (ROOT / "csrc").glob("*.cpp"))
    with pytest.raises(SystemExit, match=r"Install torch first \(pip install torch\), then pip install \."):
        setup_py.BuildExtNeedsTorch.run(object.__new__(setup_py.BuildExtNeedsTorch))


def test_the_build_backend_finds_the_installed_torch_that_isolation_hides(tmp_path, monkeypatch):
    """pip's default isolation removes the target environment's site-packages from sys.path; the backend puts
    the folder holding torch back, at the end, and only when the build environment has no torch."""
    backend = load(ROOT / "build_backend" / "adacc_build_backend.py", "adacc_build_backend_under_test")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    monkeypatch.setattr(backend.sysconfig, "get_path", lambda key: str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert backend.expose_installed_torch() is None  # torch importable here: nothing to do
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: None)
    assert backend.expose_installed_torch() == str(tmp_path)
    assert sys.path[-1] == str(tmp_path)
    assert backend.build_wheel.__self__.__class__.__module__ == "setuptools.build_meta"


def test_build_requirements_pull_no_torch_and_no_wheel():
    requires = [Requirement(r).name for r in PYPROJECT["build-system"]["requires"]]
    assert "torch" not in requires and "wheel" not in requires and "pybind11" not in requires
    assert PYPROJECT["build-system"]["backend-path"] == ["build_backend"]


def test_megatron_core_is_bounded_to_the_supported_lines():
    from megatron_adacc.compat.versions import SUPPORTED_LINES

    deps = {Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["dependencies"]}
    spec = deps["megatron-core"].specifier
    for minor in range(14, 23):
        for patch in (1, 2):
            version = f"0.{minor}.{patch}"
            assert spec.contains(version) == ((0, minor) in SUPPORTED_LINES and version != "0.16.0"), version
    assert deps["pulp"].specifier.contains("4.2.0") and "highspy" in deps
    assert "pybind11" not in deps and "matplotlib" not in deps
    assert PYPROJECT["project"]["optional-dependencies"]["plots"] == ["matplotlib"]


def test_classifiers_name_every_supported_python_and_the_package_is_typed():
    classifiers = PYPROJECT["project"]["classifiers"]
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert (ROOT / "megatron_adacc" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["megatron_adacc"]


def test_an_installed_package_writes_bench_results_under_the_current_directory(tmp_path, monkeypatch):
    from megatron_adacc.bench import harness

    installed = tmp_path / "site-packages"
    (installed / "megatron_adacc").mkdir(parents=True)
    monkeypatch.setattr(harness, "REPO_ROOT", installed)
    monkeypatch.chdir(tmp_path)
    assert harness.results_dir() == tmp_path / "benchmarks" / "results"
    assert harness.results_dir(type("Args", (), {"quick": True})()) == tmp_path / "benchmarks" / "results" / "quick"
    assert not (installed / "benchmarks").exists()


def test_plots_without_matplotlib_are_skipped_in_one_line(monkeypatch, capsys):
    from megatron_adacc.bench import harness

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert harness.pyplot() is None
    assert capsys.readouterr().out == "matplotlib is not installed, so no plots: pip install 'megatron-adacc[plots]'\n"
