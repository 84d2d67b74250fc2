"""One rank of a 2-rank torchrun job: megatron-core GPT + setup_adama over Megatron's data-parallel group.

Usage: torchrun --nproc_per_node 2 adama_megatron_dp_worker.py OUT N STEPS. Rank r trains on micro-batches
[r*N, (r+1)*N) of each mini-batch of 2N (see ``microbatch_seeds``); rank 0 writes the final parameters.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch


def microbatch_seeds(step: int, total: int) -> list[int]:
    return [1000 * step + i for i in range(total)]


def run(n_local: int, steps: int, rank: int, world: int) -> list[torch.Tensor]:
    from megatron_adacc.optim.megatron import setup_adama
    from megatron_adacc.testing import build_tiny_gpt, tiny_batch

    model = build_tiny_gpt(hidden_dropout=0.0, attention_dropout=0.0)
    args = SimpleNamespace(lr=3e-3, min_lr=3e-3, weight_decay=0.1, micro_batch_size=2,
                           global_batch_size=2 * n_local * world, clip_grad=0.0)
    _, opt = setup_adama(args, [model], model.config)
    assert opt.optimizer.num_microbatches == n_local
    for step in range(steps):
        opt.zero_grad()
        for seed in microbatch_seeds(step, n_local * world)[rank * n_local:(rank + 1) * n_local]:
            tokens, position_ids, mask, labels = tiny_batch(batch_size=2, seed=seed)
            loss = model(tokens, position_ids, mask, labels=labels).float().mean()
            (loss / n_local).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    import torch.distributed as dist

    from megatron_adacc.testing import init_distributed_single

    out, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    init_distributed_single()  # under torchrun: gloo over the launched world, megatron DP group = world
    params = run(n, steps, dist.get_rank(), dist.get_world_size())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, params)
    if dist.get_rank() == 0:
        torch.save(gathered, out)


if __name__ == "__main__":
    from megatron_adacc.testing import exit_torchrun_worker

    main()
    exit_torchrun_worker()
