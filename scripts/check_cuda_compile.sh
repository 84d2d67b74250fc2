#!/usr/bin/env bash
# Compile-check the CUDA kernels on a machine without a GPU: each csrc/cuda/*.cu is compiled to an object
# file in a temporary directory with torch's headers and the flags setup.py's CUDAExtension uses (nothing
# is linked or run), and bindings.cpp is syntax-checked with the CUDA routing enabled.
#
#   scripts/check_cuda_compile.sh            # arches: 8.0;9.0 with nvcc >= 13, else 7.0;8.0;9.0
#   TORCH_CUDA_ARCH_LIST="8.0" scripts/check_cuda_compile.sh
#
# Environment: PYTHON (default: .venv/bin/python, else python3), NVCC (default: nvcc on PATH or
# $CUDA_HOME/bin/nvcc).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
nvcc="${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}"
[[ -x "$nvcc" ]] || { echo "check_cuda_compile: nvcc not found (set NVCC or CUDA_HOME)" >&2; exit 2; }

mapfile -t includes < <("$python" - <<'PY'
import sysconfig
from torch.utils.cpp_extension import include_paths
for p in include_paths():
    print(p)
print(sysconfig.get_paths()["include"])
PY
)
abi="$("$python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"

nvcc_major="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  if (( nvcc_major >= 13 )); then TORCH_CUDA_ARCH_LIST="8.0;9.0"; else TORCH_CUDA_ARCH_LIST="7.0;8.0;9.0"; fi
fi
arch_flags=()
IFS=';' read -ra arches <<< "$TORCH_CUDA_ARCH_LIST"
for a in "${arches[@]}"; do
  sm="${a//./}"
  arch_flags+=("-gencode=arch=compute_${sm},code=sm_${sm}")
done

inc_flags=("-I$root/csrc")
for p in "${includes[@]}"; do inc_flags+=("-I$p"); done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# torch's CPU wheels ship the c10/cuda headers but not the header CMake generates for CUDA builds; it only
# marks c10_cuda as a shared library. Provide that one-line stand-in when it is missing.
if ! ls "${includes[0]}/c10/cuda/impl/cuda_cmake_macros.h" >/dev/null 2>&1; then
  mkdir -p "$tmp/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
  inc_flags+=("-I$tmp/stub")
  echo "(using a stand-in c10/cuda/impl/cuda_cmake_macros.h: this torch is a CPU build)"
fi

# The defines below are torch's COMMON_NVCC_FLAGS plus what setup.py adds.
common=(-std=c++20 -O3 --fmad=false -DADACC_WITH_CUDA -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
        "-D_GLIBCXX_USE_CXX11_ABI=$abi" -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
        -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr
        -Xcompiler -fPIC)

status=0
for cu in "$root"/csrc/cuda/*.cu; do
  obj="$tmp/$(basename "${cu%.cu}").o"
  echo "nvcc $(basename "$cu") [${TORCH_CUDA_ARCH_LIST}]"
  if "$nvcc" -c "$cu" -o "$obj" "${common[@]}" "${arch_flags[@]}" "${inc_flags[@]}"; then
    echo "  ok: $(stat -c %s "$obj") bytes"
  else
    status=1
  fi
done

echo "g++ -fsyntax-only bindings.cpp (CUDA routing)"
if g++ -fsyntax-only -std=c++20 -DADACC_WITH_CUDA -DTORCH_EXTENSION_NAME=_C "-D_GLIBCXX_USE_CXX11_ABI=$abi" \
    "${inc_flags[@]}" "$root/csrc/bindings.cpp"; then
  echo "  ok"
else
  status=1
fi
exit "$status"
