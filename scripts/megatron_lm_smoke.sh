#!/usr/bin/env bash
# GPU acceptance check of the Megatron-LM integration: 20 iterations of the patched pretrain_gpt.py with mock
# data and --transformer-impl local, for stock Megatron (none), Megatron full recompute and Adacc auto, on one
# GPU. Writes megatron_lm_smoke.json (device, date, step time, tokens/s, peak memory) to RESULTS_DIR
# (default benchmarks/results) and the runs' logs to OUT_DIR.
#
#   MEGATRON_DIR=/path/to/patched/Megatron-LM scripts/megatron_lm_smoke.sh
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="${OUT_DIR:-$HERE/benchmarks/logs/megatron_lm_smoke}"
mkdir -p "$out_dir"
# A small GPT (8 x 1024, 16 heads, 1024 tokens) so the three runs take a few minutes on any GPU.
small=(--num-layers 8 --micro-batch-size 4 --global-batch-size 4 --train-iters 20 --lr-warmup-iters 0)
status=0
for method in baseline full-recompute adacc-auto; do
    log="$out_dir/${method}-mbs4.log"
    NPROC_PER_NODE=1 LOG_INTERVAL=5 "$HERE/scripts/megatron_lm_train.sh" gpt-345m "$method" "${small[@]}" \
        >"$log" 2>&1
    rc=$?
    echo "$method: exit $rc ($log)"
    [ "$rc" -eq 0 ] || status=1
done
(cd "$HERE" && "${PYTHON:-python}" -m megatron_adacc.bench.megatron_lm_logs --summarize "$out_dir" \
    --name megatron_lm_smoke --seq-length 1024 --output-dir "${RESULTS_DIR:-$HERE/benchmarks/results}" \
    --config-json '{"model": "gpt-345m with 8 layers", "gpus": 1, "iters": 20, "data": "mock"}')
exit "$status"
