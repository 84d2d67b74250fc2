"""torchrun worker: torch.nn.parallel.DistributedDataParallel with the ResiReduce communication hook on 2
gloo ranks; prints one JSON line per configuration (``scheme:compressor[:transport]``, or ``default``) on
rank 0."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist

from megatron_adacc.testing import exit_torchrun_worker


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def run(spec: str) -> dict:
    from megatron_adacc.comm.compressors import build_compressor
    from megatron_adacc.comm.ddp_hook import ResiReduceHookState, resireduce_hook
    from megatron_adacc.comm.memories import build_memory

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if spec != "default":
        scheme, compressor, *transport = spec.split(":")
        state = ResiReduceHookState(model, build_compressor(compressor, density=0.1, seed=rank),
                                    lambda: build_memory(scheme, group_size=2), transport=(transport or ["auto"])[0])
        ddp.register_comm_hook(state, resireduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        x = torch.randint(0, 32, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), (x + 1) % 32)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    out = {"spec": spec, "losses": losses,
           "max_param_diff": max((g - gathered[0]).abs().max().item() for g in gathered),
           "param_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
    if state is not None:
        out["residual_bytes"] = state.residual_bytes()
        out["bytes_sent"] = state.traffic.total.sent
        out["full_bytes"] = sum(p.numel() * 4 for p in model.parameters())
        out["transports"] = sorted({name for _, r in state.reducers.values() for name in r.transports().values()})
    return out


def main() -> None:
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:
        result = run(spec)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    exit_torchrun_worker(0)


if __name__ == "__main__":
    main()
