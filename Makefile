# Two commands on a fresh machine (see README.md):  make demo  |  make test
# Both create or reuse .venv, install what they need, then run.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel. On a GPU node use NVIDIA's container (Dockerfile) instead of this Makefile.
TORCH  ?= torch==2.13.0
MCORE  ?= megatron-core==0.16.1
STAMP  := $(VENV)/.adacc-installed
SOURCES := pyproject.toml setup.py $(wildcard build_backend/*.py csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)

.PHONY: demo test test-all test-megatron-lm test-package test-py312 lint bench-quick install clean

demo: $(STAMP)
	$(VENV)/bin/adacc train

test: $(STAMP)
	ADACC_REQUIRE_EXT=1 $(PY) -m pytest -n 2 -m "not slow" --timeout 900 -q -p no:cacheprovider

test-all: $(STAMP)
	ADACC_REQUIRE_EXT=1 $(PY) -m pytest -n 2 --timeout 1800 -q

# CI tier 2: Megatron-LM's real training loop (megatron-core 0.19.2's megatron.training, Python 3.12, PyPI only)
# with every feature, compared bit for bit with stock Megatron (tests/megatron_lm_training).
test-megatron-lm:
	PY=$$(scripts/megatron_lm_env312.sh) && $$PY -m pytest tests/megatron_lm_training -q -p no:cacheprovider \
	    --timeout 2400 -s

# CI: the sdist, a wheel built from it as `pip install .` builds one, installed into a fresh environment outside
# the checkout, `adacc train` from another directory (scripts/ci_package_check.sh; ~2 min with a warm cache).
test-package:
	scripts/ci_package_check.sh

# CI: the solver and --adacc-policy auto on Python 3.12 with PuLP 4 + highspy, megatron-core 0.19.2
# (scripts/ci_python312_check.sh, in test-megatron-lm's environment).
test-py312:
	scripts/ci_python312_check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check megatron_adacc tests

install: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q "$(MCORE)" "pulp>=2.7" highspy numpy packaging tqdm "setuptools>=77" ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf build megatron_adacc/_C*.so *.egg-info

# The CUDA kernels compiled for sm_70, sm_80 and sm_90 without a GPU, each checked with cuobjdump: nvcc builds
# what it can, and clang with PyPI's CUDA 12.9 ptxas the sm_70 that nvcc 13 dropped (cached under ~/.cache).
.PHONY: check-cuda
check-cuda: $(STAMP)
	PYTHON=$(PY) scripts/check_cuda_compile.sh
