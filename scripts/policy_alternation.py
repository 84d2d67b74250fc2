"""Per-step cost of Adacc's policies inside one `adacc train` process, against the stock layer.

    python scripts/policy_alternation.py [CONFIG] [ROUNDS]      # default: llama-tiny, 20 rounds

The model, data and optimizer are built once, as `adacc train --config CONFIG --attention-backend flash
--attention-dropout 0` builds them; each training step then runs under the next policy in turn (stock, keep
everything, `linear_fc1` compressed in every layer, every op compressed in plain INT4, Adacc's `recompute`
preset). Printed: each policy's median step and the median of its paired differences against the stock step of
the same round. Separate processes on a shared host spread by up to half a step; steps moments apart do not.
"""

import statistics
import sys
import time
from argparse import ArgumentParser

from megatron_adacc.adacc.integration import install
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.training import loop
from megatron_adacc.training.args import add_train_args, parse_train_args


def main(config: str = "llama-tiny", rounds: int = 20) -> None:
    argv = ["--config", config, "--attention-backend", "flash", "--attention-dropout", "0",
            "--adacc-policy", "keep", "--train-iters", str(10 * (rounds + 1)), "--no-progress"]
    args = parse_train_args(argv, add_train_args(ArgumentParser()))
    run = loop._set_up(args)
    n = args.num_layers
    variants = {"stock": None, "keep": Policy.all_keep(n), "fc1-int4": Policy.uniform({"linear_fc1": "compress"}, n),
                "quantize-all": Policy.quantize_all(n), "recompute": Policy.preset("recompute", n)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    saved: list[int] = []
    step = 0
    for r in range(rounds + 1):  # the first round warms up
        for name, policy in variants.items():
            install(policy, run.model.config, predict_memory=False)
            step += 1
            t0 = time.perf_counter()
            loop._train_step(run, step, saved)
            if r:
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        paired = statistics.median(a - b for a, b in zip(ts, times["stock"]))
        print(f"{name:13s} step {statistics.median(ts) * 1e3:7.1f} ms   over stock {paired * 1e3:+7.1f} ms")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["llama-tiny"]), *(int(a) for a in sys.argv[2:3]))
