#!/usr/bin/env bash
# The GPU acceptance run (issue #24), one command on a machine with an NVIDIA GPU:
#   1. build the extension with its CUDA kernels (for this GPU's architecture) and check it loads them;
#   2. the codec tests with the kernel exactness tests on CUDA (ADACC_TEST_DEVICE=cuda: every kernel on the GPU
#      equals the pure-torch reference bit for bit) and the runtime exactness tests;
#   3. Adacc on the SDPA attention with attention dropout, which only a GPU kernel takes (scripts/gpu_sdpa_check.py:
#      exact against stock and Megatron's full recompute, at or below its bytes; float32 and bf16);
#   4. one training step of each feature on CUDA under torch.cuda.set_sync_debug_mode("warn"), against stock
#      Megatron's same step (tests/gpu_ready/test_host_syncs.py): any synchronizing call a feature adds, with
#      its call site, including those in compiled code that the CPU test's counter cannot see;
#   5. adacc bench codecs (CPU and CUDA; float32, float16, bfloat16);
#   6. adacc bench budget --quick;
#   7. the Megatron-LM smoke run (scripts/megatron_lm_smoke.sh; needs a patched Megatron-LM in MEGATRON_DIR,
#      which the Docker image has).
# Every step runs even when one before it failed; each writes its log, and summary.txt lists them all, under
# benchmarks/gpu/<UTC date>-<GPU name>/. Exit status: 0 when every step passed, 1 otherwise, 2 without a GPU.
#
#   scripts/gpu_acceptance.sh
#
# Environment: PYTHON (default python: a torch with CUDA), MEGATRON_DIR (default /opt/megatron-lm), OUT (the
# results folder), TORCH_CUDA_ARCH_LIST (default: this GPU's compute capability), STEPS (the steps to run, by name,
# separated by spaces; default all: a short lease runs what fits, the others are listed as skipped), STEP_TIMEOUT_S
# (each step's time limit; default none).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python}"
no_gpu() { echo "gpu_acceptance: no GPU: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi not found"
device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
[[ -n "$device" ]] || no_gpu "nvidia-smi lists no device"
"$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
  || no_gpu "$device is listed, but torch.cuda.is_available() is False for $python"

slug="$(tr -cs 'A-Za-z0-9' '-' <<<"$device" | sed 's/^-*//; s/-*$//')"
out="${OUT:-$root/benchmarks/gpu/$(date -u +%Y-%m-%d)-$slug}"
mkdir -p "$out"
summary="$out/summary.txt"
{
  echo "device: $device"
  nvidia-smi --query-gpu=driver_version,memory.total,compute_cap --format=csv,noheader | sed 's/^/gpu: /'
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)$(
    git -C "$root" diff --quiet 2>/dev/null || echo ' (modified)')"
  "$python" -c 'import torch; print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}")'
  echo "nvcc: $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
} >"$summary"
capability="$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$capability}"
# The test suite caps each test's address space (tests/conftest.py); a CUDA context reserves far more.
export ADACC_TEST_MEMORY_CAP_GIB="${ADACC_TEST_MEMORY_CAP_GIB:-1048576}"
export ADACC_REQUIRE_EXT=1

status=0
# step NAME COMMAND...: run it from the checkout, log to $out/NAME.log, record the outcome in the summary.
step() {
  local name="$1" t0=$SECONDS rc
  shift
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $name "* ]]; then
    printf '%-22s %-7s\n' "$name" skipped | tee -a "$summary"
    return
  fi
  echo "== $name: $*"
  if [[ -n "${STEP_TIMEOUT_S:-}" ]]; then  # through bash: timeout runs no shell function (build, smoke) itself
    (cd "$root" && timeout "$STEP_TIMEOUT_S" bash -c '"$@"' step "$@") >"$out/$name.log" 2>&1
  else
    (cd "$root" && "$@") >"$out/$name.log" 2>&1
  fi
  rc=$?
  (( rc == 0 )) || status=1
  printf '%-22s %-7s %5d s  %s\n' "$name" "$( ((rc)) && echo "FAIL($rc)" || echo ok)" $((SECONDS - t0)) "$name.log" \
    | tee -a "$summary"
}

# shellcheck disable=SC2329  # build and smoke run through step
build() {
  ADACC_BUILD_CUDA=1 MAX_JOBS="$(nproc)" "$python" setup.py build_ext --inplace \
    && "$python" -c 'import torch; from megatron_adacc import _C; assert _C.with_cuda, "no CUDA kernels"; print(_C.__file__)'
}

# shellcheck disable=SC2329
smoke() {
  local megatron="${MEGATRON_DIR:-/opt/megatron-lm}"
  if [[ ! -f "$megatron/pretrain_gpt.py" ]]; then
    echo "no patched Megatron-LM: set MEGATRON_DIR (the Docker image has /opt/megatron-lm)"
    return 3
  fi
  MEGATRON_DIR="$megatron" OUT_DIR="$out/megatron_lm_smoke" RESULTS_DIR="$out" PYTHON="$python" \
    scripts/megatron_lm_smoke.sh
}

export python out
export -f build smoke
step build build
step codec-tests env ADACC_TEST_DEVICE=cuda "$python" -m pytest tests/codecs -q -p no:cacheprovider \
  --junitxml="$out/codec-tests.xml"
step exact-tests "$python" -m pytest tests/runtime/test_exact.py -q -p no:cacheprovider \
  --junitxml="$out/exact-tests.xml"
step sdpa-check "$python" scripts/gpu_sdpa_check.py --device cuda
step sdpa-check-bf16 "$python" scripts/gpu_sdpa_check.py --device cuda --bf16
step sync-debug env ADACC_TEST_DEVICE=cuda "$python" -m pytest tests/gpu_ready/test_host_syncs.py -q \
  -p no:cacheprovider -k on_a_gpu --junitxml="$out/sync-debug.xml"
step bench-codecs "$python" -m megatron_adacc.cli bench codecs --output-dir "$out/codecs"
step bench-budget "$python" -m megatron_adacc.cli bench budget --quick --output-dir "$out/budget"
step megatron-smoke smoke

echo "gpu_acceptance: $( ((status)) && echo "FAILED" || echo "passed") on $device; results in $out"
exit "$status"
