"""One rank of the 2-rank gloo AdamA run used by test_adama_distributed.py (run as a script)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_adacc.optim import AdamA


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_data(steps: int, total_microbatches: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
             for _ in range(total_microbatches)] for _ in range(steps)]


def train(model, opt, data) -> None:
    for minibatch in data:
        opt.zero_grad()
        for x, y in minibatch:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


OPT_KW = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "decoupled_weight_decay": True}


def main() -> None:
    init_file, out = sys.argv[1], sys.argv[6]
    rank, world, n, steps = (int(a) for a in sys.argv[2:6])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = make_model()
    opt = AdamA(model.parameters(), num_microbatches=n, data_parallel_group=dist.group.WORLD, **OPT_KW)
    data = [mb[rank * n:(rank + 1) * n] for mb in make_data(steps, n * world)]
    train(model, opt, data)
    torch.save({"params": [p.detach() for p in model.parameters()],
                "m": [opt.state[p]["exp_avg"] for p in model.parameters()],
                "v": [opt.state[p]["exp_avg_sq"] for p in model.parameters()]}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
