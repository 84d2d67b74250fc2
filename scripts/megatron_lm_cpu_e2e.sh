#!/usr/bin/env bash
# Developer tier: the end-to-end matrix through a real Megatron-LM checkout's pretrain_gpt.py, on a CPU.
#
#   scripts/megatron_lm_cpu_e2e.sh MEGATRON_LM_DIR [CASE...]
#
# MEGATRON_LM_DIR is an unpatched Megatron-LM git checkout (obtained by you; never committed here). The
# script makes a patched worktree of the same commit beside it (scripts/apply_patches.sh), then trains every
# case of megatron_adacc/testing/e2e.py twice over: stock cases through the unpatched pretrain_gpt.py, plugin
# cases through the patched one, all under the CPU harness (megatron_adacc/testing/megatron_lm_cpu.py). The
# table (bit-identity per case) is printed and written to
# benchmarks/megatron_lm/cpu-e2e-<date>-<commit>.md. Exit status 0 when every case meets its check.
#
# Environment: the Python 3.12 environment of the CI tier (scripts/megatron_lm_env312.sh) unless PYTHON is
# set; WORKDIR (default /tmp/megatron-adacc-e2e) holds the patched worktree, runs and logs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

[ $# -ge 1 ] || { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
MLM="$(cd "$1" && pwd)"
shift
[ -f "$MLM/pretrain_gpt.py" ] || { echo "megatron_lm_cpu_e2e: no pretrain_gpt.py in $MLM" >&2; exit 2; }
if grep -q megatron_adacc "$MLM/pretrain_gpt.py"; then
    echo "megatron_lm_cpu_e2e: $MLM is patched; give the unpatched checkout (the script patches a copy)" >&2
    exit 2
fi
COMMIT="$(git -C "$MLM" rev-parse HEAD)"
WORKDIR="${WORKDIR:-/tmp/megatron-adacc-e2e}/${COMMIT:0:12}"
PATCHED="$WORKDIR/patched"

PYTHON="${PYTHON:-$("$HERE/scripts/megatron_lm_env312.sh")}"
# Megatron-LM's dataset helpers build with `make`, which asks python3-config of the running Python for the
# extension suffix: the environment's interpreter and its base installation's python3-config come first.
BASE_BIN="$("$PYTHON" -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin"))')"
PATH="$(dirname "$PYTHON"):$BASE_BIN:$PATH"
export PATH

mkdir -p "$WORKDIR"
if [ ! -f "$PATCHED/pretrain_gpt.py" ]; then
    git -C "$MLM" worktree add --detach "$PATCHED" "$COMMIT" >&2
fi
"$HERE/scripts/apply_patches.sh" "$PATCHED" >&2

OUT="$HERE/benchmarks/megatron_lm/cpu-e2e-$(date -u +%Y-%m-%d)-${COMMIT:0:12}.md"
cd "$HERE"
"$PYTHON" -m megatron_adacc.testing.e2e --checkout "$PATCHED" --unpatched "$MLM" --workdir "$WORKDIR/runs" \
    --out "$OUT" "$@"
