"""Run under torchrun: train with Megatron DDP over gloo, then check parameters are identical across ranks."""

import sys

import torch

from megatron_adacc.compat import quiet_fallback_warnings
from megatron_adacc.testing import exit_torchrun_worker
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

quiet_fallback_warnings()
summary, model = train(parse_train_args(sys.argv[1:]), return_model=True)
flat = torch.cat([p.detach().flatten().float() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
torch.distributed.all_gather(gathered, flat)
identical = all(torch.equal(gathered[0], g) for g in gathered)
moved = summary["losses"][0] != summary["losses"][-1]
if torch.distributed.get_rank() == 0:
    print(f"PARAMS_IDENTICAL={identical} LOSS_MOVED={moved} WORLD={summary['world_size']}")
exit_torchrun_worker(0 if identical and moved else 1)
