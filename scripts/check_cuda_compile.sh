#!/usr/bin/env bash
# Compile-check the CUDA kernels on a machine without a GPU, for V100, A100 and H100 (sm_70, sm_80, sm_90 by
# default): each csrc/cuda/*.cu is compiled in a temporary directory with torch's headers and the flags
# setup.py's CUDAExtension uses (nothing is linked or run), bindings.cpp is syntax-checked with the CUDA
# routing enabled, and cuobjdump must then list machine code for every architecture asked for.
#
#   scripts/check_cuda_compile.sh                          # 7.0;8.0;9.0
#   TORCH_CUDA_ARCH_LIST="8.0" scripts/check_cuda_compile.sh
#
# nvcc compiles what it can. nvcc 13 (and its cicc) no longer targets sm_70: those arches are compiled by
# clang with PyPI's CUDA 12.9 ptxas and headers instead (scripts/cuda_tools.sh says why and installs them).
#
# Environment: PYTHON (default: .venv/bin/python, else python3), NVCC (default: nvcc on PATH or
# $CUDA_HOME/bin/nvcc), CLANG, CUOBJDUMP.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHON="$python"
tools="$root/scripts/cuda_tools.sh"
nvcc="${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}"
[[ -x "$nvcc" ]] || { echo "check_cuda_compile: nvcc not found (set NVCC or CUDA_HOME)" >&2; exit 2; }
arch_list="${TORCH_CUDA_ARCH_LIST:-7.0;8.0;9.0}"
started=$SECONDS

mapfile -t includes < <("$python" - <<'PY'
import sysconfig
from torch.utils.cpp_extension import include_paths
for p in include_paths():
    print(p)
print(sysconfig.get_paths()["include"])
PY
)
abi="$("$python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"

# Which compiler builds which arch: nvcc >= 13 has no sm_5x..sm_72.
nvcc_release="$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
nvcc_major="${nvcc_release%%.*}"
nvcc_arches=()
clang_arches=()
IFS=';' read -ra arches <<< "$arch_list"
for a in "${arches[@]}"; do
  sm="${a//./}"
  if (( nvcc_major >= 13 && sm < 75 )); then clang_arches+=("$sm"); else nvcc_arches+=("$sm"); fi
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

# torch's COMMON_NVCC_FLAGS plus what setup.py adds; --fmad=false and -ffp-contract=off say the same.
defines=(-DADACC_WITH_CUDA -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H "-D_GLIBCXX_USE_CXX11_ABI=$abi"
         -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
         -D__CUDA_NO_HALF2_OPERATORS__)
nvcc_flags=(-std=c++20 -O3 --fmad=false --expt-relaxed-constexpr -Xcompiler -fPIC "${defines[@]}")
for sm in "${nvcc_arches[@]}"; do nvcc_flags+=("-gencode=arch=compute_${sm},code=sm_${sm}"); done

if (( ${#clang_arches[@]} )); then
  clang="$("$tools" clang)"
  cuda12="$("$tools" sm70-root)"
fi

status=0
outputs=()
for cu in "$root"/csrc/cuda/*.cu; do
  name="$(basename "${cu%.cu}")"
  if (( ${#nvcc_arches[@]} )); then
    t0=$SECONDS
    echo "nvcc ${nvcc_release} ${name}.cu [sm_${nvcc_arches[*]}]"
    if "$nvcc" -c "$cu" -o "$tmp/$name.o" "${nvcc_flags[@]}" "${inc_flags[@]}"; then
      echo "  ok: $(stat -c %s "$tmp/$name.o") bytes, $((SECONDS - t0)) s"
      outputs+=("$tmp/$name.o")
    else
      status=1
    fi
  fi
  for sm in "${clang_arches[@]}"; do
    t0=$SECONDS
    echo "$(basename "$clang") + CUDA 12.9 ptxas ${name}.cu [sm_${sm}]"
    mkdir -p "$tmp/sm_$sm"
    if "$clang" -x cuda --cuda-path="$cuda12" --cuda-gpu-arch="sm_${sm}" --cuda-device-only -Wno-unknown-cuda-version \
        -std=c++20 -O3 -ffp-contract=off "${defines[@]}" "${inc_flags[@]}" -c "$cu" -o "$tmp/sm_$sm/$name.cubin"; then
      echo "  ok: $(stat -c %s "$tmp/sm_$sm/$name.cubin") bytes, $((SECONDS - t0)) s"
      outputs+=("$tmp/sm_$sm/$name.cubin")
    else
      status=1
    fi
  done
done

echo "g++ -fsyntax-only bindings.cpp (CUDA routing)"
if g++ -fsyntax-only -std=c++20 -DADACC_WITH_CUDA -DTORCH_EXTENSION_NAME=_C "-D_GLIBCXX_USE_CXX11_ABI=$abi" \
    "${inc_flags[@]}" "$root/csrc/bindings.cpp"; then
  echo "  ok"
else
  status=1
fi

if (( status == 0 )); then
  "$root/scripts/check_cuda_arches.sh" "$arch_list" "${outputs[@]}" || status=1
fi
echo "check_cuda_compile: $( ((status)) && echo FAILED || echo ok ) in $((SECONDS - started)) s"
exit "$status"
