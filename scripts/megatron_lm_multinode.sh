#!/usr/bin/env bash
# Multi-node torchrun launch of the patched Megatron-LM: run this same command on every node.
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0's address> \
#       scripts/megatron_lm_multinode.sh gpt-4.7b adacc-auto [EXTRA FLAGS...]
#
# Each node starts NPROC_PER_NODE (default: all its GPUs) ranks; --global-batch-size should be
# micro-batch x NNODES x NPROC_PER_NODE (x accumulation). Under SLURM use scripts/megatron_lm_slurm.sbatch.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
export NNODES NODE_RANK MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"
# NCCL picks InfiniBand when present; set NCCL_SOCKET_IFNAME / NCCL_IB_HCA here if your fabric needs it.
exec "$(dirname "${BASH_SOURCE[0]}")/megatron_lm_train.sh" "$@"
