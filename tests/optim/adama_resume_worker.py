"""torchrun worker: ``adacc train --adama --use-distributed-optimizer`` (bf16, clipping) for 4 iterations straight,
and 2 + save + load + 2; prints the loss curves, the final parameters' agreement, and a resume whose shards are
left as the fresh optimizer's, on rank 0 (run by tests/optim/test_adama_distributed_resume.py)."""

from __future__ import annotations

import json
import sys

import torch

COMMON = ["--device", "cpu", "--no-progress", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
          "4", "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "0", "--lr", "3e-3",
          "--min-lr", "3e-3", "--bf16", "--adama", "--use-distributed-optimizer", "--clip-grad", "1.0",
          "--ddp-bucket-size", "5000"]


def main() -> None:
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.optim.distributed import DistributedAdamA
    from megatron_adacc.testing import exit_torchrun_worker, not_restored
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    quiet_fallback_warnings()
    workdir = sys.argv[1]
    straight, model = train(parse_train_args(COMMON + ["--train-iters", "4"]), return_model=True)
    rank = torch.distributed.get_rank()
    straight_params = [p.detach().clone() for p in model.parameters()]
    first_two = train(parse_train_args(COMMON + ["--train-iters", "2", "--save", workdir]))
    saved = torch.load(f"{workdir}/rank{rank:05d}.pt", weights_only=True)["extensions"]["adama"]["shards"]
    resumed, model = train(parse_train_args(COMMON + ["--train-iters", "4", "--load", workdir]), return_model=True)
    same_params = all(torch.equal(a, b) for a, b in zip(straight_params, model.parameters()))
    # Negative control: the same resume with this rank's shards not restored must differ.
    with not_restored(DistributedAdamA, "load_shard_state"):
        without = train(parse_train_args(COMMON + ["--train-iters", "4", "--load", workdir]))
    if rank == 0:
        print("RESULT " + json.dumps({
            "straight": straight["losses"], "resumed": resumed["losses"], "first_two": first_two["losses"],
            "without_shards": without["losses"], "same_params": same_params, "saved_rank": saved["dp_rank"],
            "saved_layout": saved["layout"], "saved_keys": sorted(saved["slices"][0]),
        }), flush=True)
    exit_torchrun_worker()


if __name__ == "__main__":
    main()
