"""Run under torchrun: `adacc train` with Megatron DDP over gloo; print the losses and whether parameters are
identical across ranks (rank 0 prints one ``RESULT {json}`` line)."""

import json
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
if torch.distributed.get_rank() == 0:
    adacc = summary["extensions"].get("adacc", {})
    print("RESULT " + json.dumps({"losses": summary["losses"], "identical": identical,
                                  "world": summary["world_size"], "max_rel_error": adacc.get("max_rel_error")}))
exit_torchrun_worker()
