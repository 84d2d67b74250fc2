#!/usr/bin/env bash
# The Python 3.12 environment of the Megatron-LM CI tier: PyPI only, no GPU libraries.
#
#   scripts/megatron_lm_env312.sh          # create or reuse it, install the project, print its python
#
# megatron-core 0.19.2 (the newest release; Python 3.12 only) ships Megatron-LM's real `megatron.training`
# package. torch comes from PyPI: for Python 3.12 that is only the CUDA 13 build, which runs on a CPU. Its
# nvidia-* dependencies cannot be left out (--no-deps gives `libcudnn.so.9: cannot open shared object file` at
# `import torch`: libtorch_cuda.so links cuDNN, cuBLAS, NCCL, cuSPARSELt, NVSHMEM...), so the environment takes
# ~5.5 GB; on a machine with a warm pip cache it installs in under a minute. PuLP is what pip picks for Python
# 3.12 (4.x, which bundles no solver) with highspy, the MILP backend the package declares, so that this tier
# also checks the solver on the Python the GPU image runs.
#
# The environment lives outside the clone (default ~/.cache/megatron-adacc/venv312-<hash of the pins>), so a
# second CI run on the same machine reuses it; the project itself is installed again (editable) every time.
set -euo pipefail
cd "$(dirname "$0")/.."

# A pyenv shim named python3.12 may exist and still refuse to run (another version selected), so each
# candidate is tried rather than trusted.
PY312=
for candidate in ${ADACC_PYTHON312:-} python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PY312=$candidate
    break
  fi
done
if [ -z "$PY312" ]; then
  echo "megatron_lm_env312: no working Python 3.12 found (set ADACC_PYTHON312=/path/to/python3.12)" >&2
  exit 2
fi
# One line per pin; the venv's name hashes them, so changing a pin builds a new one.
PINS="torch==2.14.1 megatron-core==0.19.2 pulp highspy numpy packaging tqdm setuptools ninja
psutil pytest pytest-timeout"
HASH=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
VENV=${ADACC_VENV312:-$HOME/.cache/megatron-adacc/venv312-$HASH}
PY=$VENV/bin/python
PIP=(quiet "$PY" -m pip install -q --disable-pip-version-check)

# pip's extra-index-url on some machines names folders that do not exist; its notice about each is noise.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  # Environments of older pins are ~5.5 GB each: keep only the one being built.
  [ -n "${ADACC_VENV312:-}" ] || find "$(dirname "$VENV")" -maxdepth 1 -name 'venv312-*' -exec rm -rf {} +
  "$PY312" -m venv "$VENV"
  "${PIP[@]}" torch==2.14.1
  # megatron-core's own requirements are numpy and packaging; --no-deps keeps pip from resolving its extras.
  "${PIP[@]}" --no-deps megatron-core==0.19.2
  # psutil: Megatron's checkpoint saving imports it (megatron-core does not declare it).
  "${PIP[@]}" pulp highspy numpy packaging tqdm setuptools ninja psutil pytest pytest-timeout
  touch "$VENV/.complete"
fi
# The project, editable, with a CPU-only extension build (nvcc may exist, but nothing built for CUDA could run
# without a GPU). Rebuilt when this checkout or the extension's sources changed.
BUILT=$VENV/.project-$(cat setup.py pyproject.toml build_backend/*.py csrc/*.cpp csrc/*.h | { sha256sum; pwd; } |
  sha256sum | cut -c1-12)
# torch first: the extension links its libraries, which only `import torch` puts within reach.
if [ ! -f "$BUILT" ] || ! "$PY" -c "import torch, megatron_adacc._C" 2>/dev/null; then
  ADACC_BUILD_CUDA=0 "${PIP[@]}" --no-build-isolation --no-deps -e . >&2
  rm -f "$VENV"/.project-*
  touch "$BUILT"
fi
"$PY" -c "import megatron.core, megatron.training, torch, pulp, highspy; import megatron_adacc._C" >&2
echo "$PY"
