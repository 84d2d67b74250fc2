"""torchrun worker: train megatron-core's tiny GPT with ResiReduce on 2 gloo ranks, for a list of
configurations in one process (imports dominate the cost), and print one JSON line per configuration on
rank 0. Run by tests/comm/test_megatron_ddp.py and tests/comm/test_resume.py.

Configuration syntax: ``scheme:compressor:overlap[:distopt[:transport]]``, e.g. ``w+2d:topk:1`` or
``residual:topk:0:1:reduce-scatter``; scheme ``off`` runs Megatron's own reduction.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

STEPS = 3
LAYERS = 4


def run(spec: str) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_adacc.comm import build_reducer
    from megatron_adacc.comm.megatron_ddp import attach
    from megatron_adacc.testing import build_tiny_gpt, tiny_batch, tiny_config

    parts = spec.split(":")
    scheme, compressor, overlap = parts[0], parts[1], parts[2] == "1"
    distopt = len(parts) > 3 and parts[3] == "1"
    transport = parts[4] if len(parts) > 4 else "auto"
    model = build_tiny_gpt(seq_length=16, num_layers=LAYERS, hidden_dropout=0.0, attention_dropout=0.0)
    rank = torch.distributed.get_rank()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=distopt,
        # With overlap: several bucket groups (two layers each), reduced from the backward hooks.
        bucket_size=60_000 if overlap else None,
    )
    ddp = DistributedDataParallel(config=tiny_config(num_layers=LAYERS), ddp_config=ddp_config, module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distopt), [ddp]
    )
    attachment = None
    if scheme != "off":
        reducer = build_reducer(scheme, compressor, density=0.05, group_size=2, seed=rank, transport=transport)
        attachment = attach(ddp, reducer)
    losses = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        tokens, position_ids, mask, labels = tiny_batch(batch_size=2, seq_length=16, seed=100 * step + rank)
        loss = ddp(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    result = {
        "spec": spec,
        "max_param_diff": max((g - gathered[0]).abs().max().item() for g in gathered),
        "losses": losses,
        "bucket_groups": len(ddp.bucket_groups),
        "param_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
    }
    if attachment is not None:
        mem = attachment.reducer.memory
        result.update(
            residual_bytes=mem.residual_bytes(),
            formula_bytes=mem.formula_bytes(),
            full_residual_bytes=sum(s.numel * 4 for s in attachment.slots),
            groups=len(getattr(mem, "plan", None).groups) if hasattr(mem, "plan") else 0,
            bytes_sent=attachment.reducer.traffic.total.sent,
            transport="+".join(sorted(set(attachment.reducer.transports().values()))),
            owner_residual_bytes=attachment.reducer.residual_bytes() - mem.residual_bytes(),
            uncompressed_bytes_per_step=attachment.uncompressed_bytes_per_step,
        )
        attachment.detach()
    return result


def main() -> None:
    from megatron_adacc.testing import memory_cap

    with memory_cap(6):
        for spec in sys.argv[1:]:
            try:
                result = run(spec)
            except Exception as exc:  # reported to the test, which decides
                result = {"spec": spec, "error": f"{type(exc).__name__}: {exc}"}
            if torch.distributed.get_rank() == 0:
                print("RESULT " + json.dumps(result), flush=True)
    from megatron_adacc.testing import exit_torchrun_worker

    exit_torchrun_worker()


if __name__ == "__main__":
    main()
