#!/usr/bin/env bash
# The CUDA tools the compile checks need beyond the machine's nvcc, each printed as one path and cached
# under ~/.cache/megatron-adacc (or $ADACC_CACHE):
#
#   scripts/cuda_tools.sh cuobjdump   # cuobjdump: on PATH, in $CUDA_HOME/bin, else PyPI's nvidia-cuda-cuobjdump
#   scripts/cuda_tools.sh sm70-root   # a CUDA 12.9 tree (ptxas, headers, libdevice) from PyPI's wheels
#   scripts/cuda_tools.sh clang       # clang++ 19 (Debian's clang-19, installed with apt-get where missing)
#
# Why sm_70 takes clang: CUDA 13 dropped sm_70 (V100) from nvcc and cicc alike, and PyPI's CUDA 12 nvcc
# wheels (nvidia-cuda-nvcc-cu12, every version) ship ptxas and libnvvm but no nvcc driver, cudafe++ or
# cicc. clang compiles CUDA itself and hands its PTX to that CUDA 12.9 ptxas, which still emits sm_70.
#
# Environment: PYTHON (runs pip; default python3), ADACC_CACHE, CLANG (a clang++ to use instead).
set -euo pipefail

cache="${ADACC_CACHE:-$HOME/.cache/megatron-adacc}"
python="${PYTHON:-python3}"
# Pinned: the versions the sm_70 check was established with (CUDA 12.9: the last toolkit with sm_70).
CUDA12_WHEELS=(nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-cccl-cu12==12.9.27)
CUOBJDUMP_WHEEL=nvidia-cuda-cuobjdump==13.4.92
CLANG_PACKAGE=clang-19

die() { echo "cuda_tools: $*" >&2; exit 2; }

# pip-install wheels (no dependencies) into directory $1 once; a marker file records that it completed.
install_wheels() {
  local dir="$1"; shift
  [[ -f "$dir/.complete" ]] && return 0
  rm -rf "$dir"
  # pip's extra-index-url on some machines names folders that do not exist; its notice about each is noise.
  "$python" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) >&2 \
    || die "pip could not install $* (PyPI unreachable?)"
  touch "$dir/.complete"
}

find_cuobjdump() {
  local found toolkit="${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump"
  found="$(command -v cuobjdump || true)"
  [[ -z "$found" && -x "$toolkit" ]] && found="$toolkit"
  if [[ -z "$found" ]]; then
    install_wheels "$cache/cuobjdump-13.4" "$CUOBJDUMP_WHEEL"
    found="$(find "$cache/cuobjdump-13.4" -type f -name cuobjdump | head -n 1)"
  fi
  [[ -x "$found" ]] || die "no cuobjdump found or installable"
  echo "$found"
}

# A CUDA root as clang's --cuda-path expects it, made of links into the wheels.
sm70_root() {
  local wheels="$cache/cuda12.9-wheels" root="$cache/cuda12.9-root"
  install_wheels "$wheels" "${CUDA12_WHEELS[@]}"
  if [[ ! -f "$root/.complete" ]]; then
    rm -rf "$root"
    mkdir -p "$root/bin" "$root/nvvm" "$root/include"
    ln -s "$wheels/nvidia/cuda_nvcc/bin/ptxas" "$root/bin/ptxas"
    ln -s "$wheels/nvidia/cuda_nvcc/nvvm/libdevice" "$root/nvvm/libdevice"
    local part
    for part in cuda_runtime cuda_nvcc cuda_cccl; do cp -rs "$wheels/nvidia/$part/include/." "$root/include/"; done
    # clang's CUDA wrapper includes curand's device header; the codecs use no curand, and its wheel is large.
    : > "$root/include/curand_mtgp32_kernel.h"
    echo '{"cuda": {"name": "CUDA SDK", "version": "12.9.1"}}' > "$root/version.json"
    touch "$root/.complete"
  fi
  echo "$root"
}

find_clang() {
  local c
  for c in "${CLANG:-}" clang++-19 clang++-20 clang++-18; do
    [[ -n "$c" ]] && command -v "$c" >/dev/null && { command -v "$c"; return 0; }
  done
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get install -y -qq "$CLANG_PACKAGE" \
        || { apt-get update -qq && apt-get install -y -qq "$CLANG_PACKAGE"; }; } >&2 \
      || die "apt-get could not install $CLANG_PACKAGE"
    command -v clang++-19 && return 0
  fi
  die "no clang++ 18-20 for the sm_70 compile (install $CLANG_PACKAGE or set CLANG)"
}

case "${1:-}" in
  cuobjdump) find_cuobjdump ;;
  sm70-root) sm70_root ;;
  clang) find_clang ;;
  *) die "usage: $0 cuobjdump|sm70-root|clang" ;;
esac
