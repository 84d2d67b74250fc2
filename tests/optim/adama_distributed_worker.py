"""One rank of a torchrun job for test_adama_distributed_optimizer.py: AdamA with the distributed optimizer on a
megatron-core GPT over gloo, against the computations it must equal, run in the same job.

Usage: torchrun --nproc_per_node M adama_distributed_worker.py OUT. Rank 0 writes a dict of results to OUT:

* ``single``: ``N = 2`` micro-batches per rank against single-process AdamA (rank 0, no data parallelism) over
  ``N`` micro-batches of ``M x b`` samples, the ``i``-th being the ranks' ``i``-th micro-batches together: final
  parameters and the whole ``m`` and ``v`` of both.
* ``adam`` and ``adam-clip``: ``N = 1`` against Megatron's DDP + distributed optimizer (Adam) on the same batches,
  without and with ``--clip-grad``; ``adam-bf16``: the same for a bf16 model (its fp32 master weights).
* ``bound``: ``N = 3`` with ``--clip-grad``: every step's first-moment update ``m_t - beta1 m_{t-1}`` (its global
  norm), and the same without clipping.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

MICRO = 2
STEPS = 3
BUCKET = 5_000  # ~30 buckets on the tiny GPT (as on a real model): order and boundaries exercised
CLIP = 0.05
BETA1 = 0.9
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def batch(step: int, micro: int, rank: int, world: int):
    from megatron_adacc.testing import tiny_batch

    return tiny_batch(batch_size=MICRO, seed=1000 * step + micro * world + rank)


def global_batch(step: int, micro: int, world: int):
    """The ranks' ``micro``-th micro-batches of ``step`` as one batch (the causal mask is shared)."""
    parts = [batch(step, micro, r, world) for r in range(world)]
    tokens, positions, labels = (torch.cat([p[i] for p in parts]) for i in (0, 1, 3))
    return tokens, positions, parts[0][2], labels


def loss_of(model, b) -> torch.Tensor:
    tokens, positions, mask, labels = b
    return model(tokens, positions, mask, labels=labels).float().mean()


def args_for(n: int, world: int, **kw) -> SimpleNamespace:
    base = {"lr": 3e-3, "min_lr": 3e-3, "weight_decay": 0.1, "micro_batch_size": MICRO,
            "global_batch_size": MICRO * n * world, "clip_grad": 0.0, "use_distributed_optimizer": True,
            "ddp_bucket_size": BUCKET, "adam_beta1": BETA1}
    return SimpleNamespace(**{**base, **kw})


def model(bf16: bool = False):
    from megatron.core.transformer.module import Float16Module

    from megatron_adacc.testing import build_tiny_gpt

    if not bf16:
        return build_tiny_gpt(**NO_DROPOUT)
    gpt = build_tiny_gpt(bf16=True, params_dtype=torch.bfloat16, **NO_DROPOUT)
    return Float16Module(gpt.config, gpt)


def train(opt, net, n: int, rank: int, world: int, after_step=None) -> list:
    """``STEPS`` steps of ``n`` micro-batches (each loss divided by ``n``, as Megatron's schedules do); returns the
    grad norms the steps report."""
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(n):
            (loss_of(net, batch(step, micro, rank, world)) / n).backward()
        norms.append(opt.step()[1])
        if after_step is not None:
            after_step()
    return norms


def full_states(opt, net) -> dict[str, dict[int, torch.Tensor]]:
    """The whole ``m`` and ``v`` (and master weights) of a DistributedAdamA, gathered from every rank's shards,
    by position of the parameter in the model."""
    inner = opt.optimizer
    order = {p: i for i, p in enumerate(net.parameters())}
    out: dict[str, dict[int, torch.Tensor]] = {}
    for shard in inner.shards:
        for key, local in shard.state_tensors().items():
            whole = torch.empty(shard.bucket.numel, dtype=local.dtype)
            dist.all_gather_into_tensor(whole, local.contiguous())
            for p, (s, e) in zip(shard.bucket.params, shard.bucket.ranges):
                out.setdefault(key, {})[order[p]] = whole[s:e].view(p.shape).clone()
    return out


def check_single(rank: int, world: int) -> dict:
    from megatron_adacc.optim.adama import AdamA
    from megatron_adacc.optim.megatron import adama_param_groups, setup_adama

    n = 2
    net = model()
    _, opt = setup_adama(args_for(n, world), [net], net.config)
    first: list = []
    train(opt, net, n, rank, world, after_step=lambda: first or first.append(full_states(opt, net)["exp_avg_sq"]))
    states = full_states(opt, net)
    if rank != 0:
        return {}
    ref = model()
    # One process, no data parallelism: AdamA with N micro-batches of M x b samples (setup_adama would join the
    # ranks' data-parallel group).
    groups = adama_param_groups([ref], 3e-3, 3e-3)
    ref_opt = AdamA(groups, lr=3e-3, betas=(BETA1, 0.999), weight_decay=0.1, decoupled_weight_decay=True,
                    num_microbatches=n, scale_by_num_microbatches=False)
    for g in ref_opt.param_groups:
        g["weight_decay"] *= g["wd_mult"]
    for step in range(STEPS):
        ref_opt.zero_grad()
        for micro in range(n):
            (loss_of(ref, global_batch(step, micro, world)) / n).backward()
        ref_opt.step()
    ref_params = list(ref.parameters())
    return {"params": [p.detach().clone() for p in net.parameters()], "ref_params": [p.detach() for p in ref_params],
            "m": states["exp_avg"], "v": states["exp_avg_sq"],
            "ref_m": {i: ref_opt.state[p]["exp_avg"] for i, p in enumerate(ref_params)},
            "ref_v": {i: ref_opt.state[p]["exp_avg_sq"] for i, p in enumerate(ref_params)},
            "v_first_step": first[0], "per_rank_v_first_step": _per_rank_squares_v(n, world)}


def _per_rank_squares_v(n: int, world: int) -> dict[int, torch.Tensor]:
    """``v`` had each rank's own micro-batch gradients been squared (Appendix B's form: AdamA over ``N x M``
    micro-batches of ``b``), from the same start: what the test tells the sharded form apart from."""
    from megatron_adacc.optim.adama import AdamA

    net = model()
    opt = AdamA(net.parameters(), lr=3e-3, betas=(BETA1, 0.999), num_microbatches=n * world)
    opt.zero_grad()
    for micro in range(n):
        for r in range(world):
            loss_of(net, batch(0, micro, r, world)).backward()
    return {i: opt.state[p]["exp_avg_sq"].clone() for i, p in enumerate(net.parameters())}


def megatron_distributed_optimizer(net, clip: float, bf16: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config=net.config, module=net, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=3e-3, min_lr=3e-3, weight_decay=0.1, clip_grad=clip, adam_beta1=BETA1, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=True), [ddp])
    for group in opt.param_groups:  # what Megatron-LM's scheduler does at every step
        group["weight_decay"] = 0.1 * group["wd_mult"]
    return ddp, opt


def check_adam(rank: int, world: int, clip: float = 0.0, bf16: bool = False) -> dict:
    from megatron_adacc.bench.adama import gradient_buffer_bytes, optimizer_state_bytes
    from megatron_adacc.optim.megatron import setup_adama

    ref_net = model(bf16)
    ddp, ref_opt = megatron_distributed_optimizer(ref_net, clip, bf16)
    ref_norms = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        ref_opt.zero_grad()
        loss_of(ddp, batch(step, 0, rank, world)).backward()
        ddp.finish_grad_sync()
        ok, norm, _ = ref_opt.step()
        assert ok
        ref_norms.append(norm)
    net = model(bf16)
    _, opt = setup_adama(args_for(1, world, clip_grad=clip, bf16=bf16), [net], net.config)
    norms = train(opt, net, 1, rank, world)
    out = {"params": [p.detach().float() for p in net.parameters()],
           "ref_params": [p.detach().float() for p in ref_net.parameters()], "norms": norms, "ref_norms": ref_norms,
           "state_bytes": opt.optimizer.state_bytes(), "ref_state_bytes": optimizer_state_bytes(ref_opt),
           "transient_grad_bytes": opt.optimizer.peak_transient_bytes,
           "largest_bucket_bytes": 4 * max(b.numel for b in opt.optimizer.buckets),
           "ref_grad_buffer_bytes": gradient_buffer_bytes(ddp)}
    if bf16:
        out["master"] = full_states(opt, net)["master_param"]
        out["ref_master"] = _megatron_masters(ref_opt, ref_net)
    return out if rank == 0 else {}


def _megatron_masters(opt, net) -> dict[int, torch.Tensor]:
    """Megatron's fp32 master weights, gathered, by position of the parameter in the model."""
    out = {}
    for i, p in enumerate(net.parameters()):
        whole = p.detach().float().clone()  # the rank's slices come from the optimizer's shards
        for inner in getattr(opt, "chained_optimizers", [opt]):
            for model_group, main_group in zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups):
                for model_param, main_param in zip(model_group, main_group):
                    if model_param is p:
                        r = inner._get_model_param_range_map(p)["param"]
                        whole.view(-1)[r.start:r.end] = main_param
        dist.all_reduce(whole.sub_(p.detach().float()))  # each element is set by its one owner
        out[i] = whole + p.detach().float()
    return out


def check_bound(rank: int, world: int) -> dict:
    from megatron_adacc.optim.megatron import setup_adama

    out = {}
    for clip in (CLIP, 0.0):
        net = model()
        _, opt = setup_adama(args_for(3, world, clip_grad=clip), [net], net.config)
        out[clip] = _first_moment_updates(opt, net, world, rank)
    return out if rank == 0 else {}


def _first_moment_updates(opt, net, world: int, rank: int) -> list[float]:
    """Train; after each step, the global norm of ``m_t - beta1 m_{t-1}`` over the ranks' shards."""
    shards = opt.optimizer.shards
    previous = [s.exp_avg.clone() for s in shards]
    updates = []

    def measure():
        total = torch.zeros(())
        for shard, before in zip(shards, previous):
            total += (shard.exp_avg - BETA1 * before).square().sum()
            before.copy_(shard.exp_avg)
        dist.all_reduce(total)
        updates.append(float(total.sqrt()))

    train(opt, net, 3, rank, world, after_step=measure)
    return updates


def main() -> None:
    from megatron_adacc.testing import exit_torchrun_worker, init_distributed_single

    out = sys.argv[1]
    torch.set_num_threads(1)
    init_distributed_single()  # under torchrun: gloo over the launched world, megatron's DP group = world
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"single": check_single(rank, world), "adam": check_adam(rank, world),
               "adam-clip": check_adam(rank, world, clip=CLIP), "adam-bf16": check_adam(rank, world, bf16=True),
               "bound": check_bound(rank, world)}
    if rank == 0:
        torch.save(results, out)
    exit_torchrun_worker()


if __name__ == "__main__":
    main()
