#!/usr/bin/env bash
# The Adacc paper's comparison (seed 000, Figure 5 and Table 3) on one GPU node with patched Megatron-LM:
# throughput and peak memory of baseline, Megatron full recompute, quantize-all and Adacc auto across
# per-GPU batch sizes. Runs that do not fit are recorded as "oom" (Table 3's maximum batch size).
#
#   scripts/megatron_lm_paper_comparison.sh MODEL [MICRO_BATCH_SIZE ...]
#
# MODEL: gpt-117m | gpt-345m | gpt-4.7b. Batch sizes default to the paper's range for the model.
# Environment: everything scripts/megatron_lm_train.sh reads, plus
#   ITERS [30]         training iterations per run (the first logged interval is left out of the median)
#   METHODS ["baseline full-recompute quantize-all adacc-auto"]
#   OUT_DIR [benchmarks/logs/megatron_lm_MODEL]   one METHOD-mbsN.log per run
# Result: benchmarks/results/megatron_lm_MODEL.json (common format; `batches` lists every batch size).
set -uo pipefail

[ $# -ge 1 ] || { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
model="$1"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"

if [ $# -gt 0 ]; then
    batches=("$@")
else
    case "$model" in
        gpt-117m) batches=(8 16 32 57 64 98 128 136) ;;
        gpt-345m) batches=(1 4 8 15 19 32 61) ;;
        gpt-4.7b) batches=(1 2 3 4) ;;
        *) echo "give the micro-batch sizes for $model" >&2; exit 2 ;;
    esac
fi
read -r -a methods <<<"${METHODS:-baseline full-recompute quantize-all adacc-auto}"
out_dir="${OUT_DIR:-$HERE/benchmarks/logs/megatron_lm_${model}}"
mkdir -p "$out_dir"
nproc="${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
world=$((nproc * ${NNODES:-1}))
seq_length="$(cd "$HERE" && "$PYTHON" -c "from megatron_adacc.megatron_lm.configs import load; print(load('$model')['seq_length'])")"

for mbs in "${batches[@]}"; do
    for method in "${methods[@]}"; do
        log="$out_dir/${method}-mbs${mbs}.log"
        echo "=== $model $method micro-batch $mbs -> $log"
        NPROC_PER_NODE="$nproc" "$HERE/scripts/megatron_lm_train.sh" "$model" "$method" \
            --micro-batch-size "$mbs" --global-batch-size $((mbs * world)) --train-iters "${ITERS:-30}" \
            --lr-warmup-iters 0 >"$log" 2>&1
        echo "    exit $?"
    done
done

config_json="{\"model\": \"$model\", \"gpus\": $world, \"iters\": ${ITERS:-30}, \"precision\": \"${PRECISION:-bf16}\", \"data\": \"${DATA_PATH:-mock}\"}"
(cd "$HERE" && "$PYTHON" -m megatron_adacc.bench.megatron_lm_logs --summarize "$out_dir" \
    --name "megatron_lm_${model}" --seq-length "$seq_length" --config-json "$config_json")
