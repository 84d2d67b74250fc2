"""torchrun worker: `adacc train` with ResiReduce for 4 iterations straight, and 2 + save + load + 2; prints
the loss curves (and a resume that drops the residuals) on rank 0 (run by tests/comm/test_resume.py)."""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    quiet_fallback_warnings()
    scheme, compressor, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
    transport = sys.argv[4] if len(sys.argv) > 4 else "auto"
    common = ["--device", "cpu", "--no-progress", "--num-layers", "4", "--hidden-size", "64",
              "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", "32",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--lr-warmup-iters", "0", "--lr", "3e-3", "--min-lr", "3e-3",
              "--resireduce", scheme,
              "--grad-compressor", compressor, "--grad-compress-density", "0.05", "--resireduce-group-size", "2",
              "--resireduce-transport", transport]
    straight = train(parse_train_args(common + ["--train-iters", "4"]))
    first_two = train(parse_train_args(common + ["--train-iters", "2", "--save", workdir]))
    saved = torch.load(f"{workdir}/rank{torch.distributed.get_rank():05d}.pt", weights_only=False)
    reducer = saved["extensions"].get("resireduce", {}).get("reducer", {})
    memory = reducer.get("memory", {})
    owners = reducer.get("communicators", {}).get("reduce-scatter", {}).get("owner_residuals", {})
    resumed = train(parse_train_args(common + ["--train-iters", "4", "--load", workdir]))
    # Negative control: the same resume with the residuals left at zero must differ.
    from megatron_adacc.comm.extension import ResiReduceExtension
    from megatron_adacc.testing import not_restored

    with not_restored(ResiReduceExtension, "load_state_dict"):
        without = train(parse_train_args(common + ["--train-iters", "4", "--load", workdir]))
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({
            "straight": straight["losses"], "resumed": resumed["losses"], "first_two": first_two["losses"],
            "resumed_without_residuals": without["losses"],
            "saved_residual_tensors": len(memory),
            "saved_residual_nonzero": sum(int(t.count_nonzero()) for t in memory.values()),
            "saved_owner_residual_nonzero": sum(int(t.count_nonzero()) for t in owners.values()),
        }), flush=True)


if __name__ == "__main__":
    from megatron_adacc.testing import exit_torchrun_worker

    main()
    exit_torchrun_worker()
