#!/usr/bin/env bash
# Every architecture of an arch list has machine code in the given files taken together (objects, cubins,
# shared libraries): cuobjdump --list-elf names one "<name>.sm_XX.cubin" per architecture it holds.
# The compile check (check_cuda_compile.sh) and the Docker build run this same check.
#
#   scripts/check_cuda_arches.sh "7.0;8.0;9.0" FILE...
#
# Environment: CUOBJDUMP (default: scripts/cuda_tools.sh cuobjdump).
set -euo pipefail

[[ $# -ge 2 ]] || { echo "usage: $0 ARCH_LIST FILE..." >&2; exit 2; }
arches="$1"
shift
cuobjdump="${CUOBJDUMP:-$("$(dirname "${BASH_SOURCE[0]}")/cuda_tools.sh" cuobjdump)}"

listing="$(for f in "$@"; do "$cuobjdump" --list-elf "$f"; done)"
echo "$listing"
missing=()
for arch in ${arches//;/ }; do
  sm="sm_${arch//./}"
  grep -q "\.${sm}\.cubin\$" <<<"$listing" || missing+=("$sm")
done
if (( ${#missing[@]} )); then
  echo "check_cuda_arches: no ${missing[*]} machine code in $*" >&2
  exit 1
fi
echo "check_cuda_arches: ok, machine code for every arch of ${arches}"
