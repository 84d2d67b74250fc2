#!/usr/bin/env bash
# One patched-Megatron-LM training run of a configs/*.toml model with one memory method.
#
#   scripts/megatron_lm_train.sh CONFIG METHOD [EXTRA MEGATRON-LM FLAGS...]
#
# CONFIG: gpt-117m | gpt-345m | gpt-4.7b | any configs/*.toml name or path.
# METHOD: baseline        no memory optimisation (--adacc-policy none: stock Megatron-LM)
#         full-recompute  Megatron's full recompute, one layer per checkpoint
#         quantize-all    the paper's "Quantization": every activation INT4 (--adacc-policy quantize-all)
#         adacc-auto      Adacc: profile, solve the MILP, train (--adacc-policy auto)
#         adacc:PATH      Adacc with a policy file written by `adacc solve`
# Later arguments go to pretrain_gpt.py unchanged and win over the config (e.g. --micro-batch-size 16).
#
# Environment (defaults in brackets):
#   MEGATRON_DIR [/opt/megatron-lm]   patched Megatron-LM checkout (scripts/apply_patches.sh)
#   NPROC_PER_NODE [all visible GPUs] NNODES [1] NODE_RANK [0] MASTER_ADDR [localhost] MASTER_PORT [29500]
#   PRECISION [bf16]                  bf16 | fp16 (V100 has no bf16; the paper trained in fp16)
#   DATA_PATH []                      Megatron .bin/.idx prefix; empty: --mock-data
#   VOCAB_FILE, MERGE_FILE []         GPT-2 BPE files, needed with DATA_PATH
#   ADACC_MEMORY_BUDGET []            --adacc-memory-budget for adacc-auto (default: the GPU's memory)
#   LOG_INTERVAL [5]                  PYTHON [python]
set -euo pipefail

[ $# -ge 2 ] || { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
config="$1"
method="$2"
shift 2

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MEGATRON_DIR="${MEGATRON_DIR:-/opt/megatron-lm}"
PYTHON="${PYTHON:-python}"
[ -f "$MEGATRON_DIR/pretrain_gpt.py" ] || {
    echo "megatron_lm_train: no pretrain_gpt.py in MEGATRON_DIR=$MEGATRON_DIR" >&2
    exit 2
}
grep -q megatron_adacc "$MEGATRON_DIR/pretrain_gpt.py" || {
    echo "megatron_lm_train: $MEGATRON_DIR is not patched; run scripts/apply_patches.sh $MEGATRON_DIR" >&2
    exit 2
}

case "$method" in
    baseline) method_flags=(--adacc-policy none) ;;
    full-recompute) method_flags=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
    quantize-all) method_flags=(--adacc-policy quantize-all) ;;
    adacc-auto)
        method_flags=(--adacc-policy auto)
        [ -z "${ADACC_MEMORY_BUDGET:-}" ] || method_flags+=(--adacc-memory-budget "$ADACC_MEMORY_BUDGET")
        ;;
    adacc:*) method_flags=(--adacc-policy "${method#adacc:}") ;;
    *)
        echo "megatron_lm_train: unknown METHOD $method (baseline, full-recompute, quantize-all, adacc-auto, adacc:PATH)" >&2
        exit 2
        ;;
esac

# The model and training settings, from the same TOML file `adacc train --config` reads.
read -r -a model_flags <<<"$(cd "$HERE" && "$PYTHON" -m megatron_adacc.megatron_lm.configs "$config")"

case "${PRECISION:-bf16}" in
    bf16) precision_flags=(--bf16) ;;
    fp16) precision_flags=(--fp16 --initial-loss-scale 65536) ;;
    *) echo "megatron_lm_train: PRECISION must be bf16 or fp16" >&2; exit 2 ;;
esac

if [ -n "${DATA_PATH:-}" ]; then
    # shellcheck disable=SC2054  # --split takes one comma-separated value
    data_flags=(--data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer
        --vocab-file "${VOCAB_FILE:?set VOCAB_FILE with DATA_PATH}" --merge-file "${MERGE_FILE:?set MERGE_FILE with DATA_PATH}"
        --split 949,50,1)
else
    data_flags=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi

# Every method uses the local layer spec (Adacc sees its ops one by one; the baselines use it too so the
# comparison is like for like) and logs step time, throughput and peak memory for megatron_adacc.bench.megatron_lm_logs.
common_flags=(
    --transformer-impl local
    --log-interval "${LOG_INTERVAL:-5}" --log-throughput --log-memory-interval "${LOG_INTERVAL:-5}"
    --eval-iters 0 --eval-interval 1000000
    --lr-decay-style cosine
)

# Without apex (a PyPI torch, many clusters' images; NGC's PyTorch containers have it) Megatron-LM stops with
# "persist_layer_norm not supported by torch LayerNorm" and "fused_weight_gradient_mlp_cuda module is not found"
# unless told not to use them.
"$PYTHON" -c "import apex.normalization" 2>/dev/null || common_flags+=(--no-persist-layer-norm)
"$PYTHON" -c "import fused_weight_gradient_mlp_cuda" 2>/dev/null || common_flags+=(--no-gradient-accumulation-fusion)

nproc="${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
set -x
exec torchrun \
    --nproc_per_node "$nproc" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-29500}" \
    "$MEGATRON_DIR/pretrain_gpt.py" \
    "${model_flags[@]}" "${precision_flags[@]}" "${data_flags[@]}" "${common_flags[@]}" "${method_flags[@]}" "$@"
