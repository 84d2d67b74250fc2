"""DistributedAdamA in one process (data-parallel size 1): the same computation as AdamA, bit for bit, bucket by
bucket; what it does with a parameter that gets no gradient; its refusals. The multi-rank math is
test_adama_distributed_optimizer.py's."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_adacc.optim import AdamA, DistributedAdamA
from megatron_adacc.optim.distributed import ShardMismatch

torch.set_num_threads(1)
KW = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3)).to(dtype)


def data(steps: int, n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)] for _ in range(steps)]


def train(model, opt, batches) -> None:
    for minibatch in batches:
        opt.zero_grad()
        for x, y in minibatch:
            out = model(x.to(next(model.parameters()).dtype)).float()
            torch.nn.functional.mse_loss(out, y).backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket_size", [None, 100])
def test_one_rank_is_adama_bit_for_bit(dtype, bucket_size):
    """Same folds, same update, same order of operations on every element: equal, not close."""
    ref, ours = make_model(dtype), make_model(dtype)
    ref_opt = AdamA(ref.parameters(), decoupled_weight_decay=True, num_microbatches=3, **KW)
    opt = DistributedAdamA([{"params": list(ours.parameters())}], num_microbatches=3, bucket_size=bucket_size, **KW)
    assert len(opt.buckets) == (1 if bucket_size is None else 3)
    batches = data(4, 3)
    train(ref, ref_opt, batches)
    train(ours, opt, batches)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)
    per_element = 8 if dtype == torch.float32 else 12  # m, v (and the fp32 master)
    padding = sum(b.numel - sum(e - s for s, e in b.ranges) for b in opt.buckets)  # the layout's alignment
    assert opt.state_bytes() == ref_opt.state_bytes() + per_element * padding


def test_a_parameter_without_gradient_is_folded_as_zeros_like_megatrons(caplog):
    """Megatron's distributed optimizer steps every parameter (its gradient buffer holds zeros); so does this, and
    it says once that such a parameter holds back the buckets after it."""
    model = make_model()
    frozen = model[4]
    opt = DistributedAdamA([{"params": list(model.parameters())}], num_microbatches=2, bucket_size=100, lr=1e-2)
    before = [p.detach().clone() for p in frozen.parameters()]
    x = torch.randn(4, 6)
    with caplog.at_level(logging.WARNING, logger="megatron_adacc"):
        for _ in range(2):
            opt.zero_grad()
            for _ in range(2):
                model[:4](x).sum().backward()  # the last layer takes no part
            opt.step()
    assert sum("received no gradient" in r.message for r in caplog.records) == 1
    for p, b in zip(frozen.parameters(), before):  # zero gradient, zero moments, no weight decay: unchanged
        assert torch.equal(p.detach(), b)
    assert all(p.grad is None for p in model.parameters())


def test_clipping_bounds_each_microbatch_and_the_first_moment_update():
    model = make_model()
    clip, n, beta1 = 0.01, 3, 0.9
    opt = DistributedAdamA([{"params": list(model.parameters())}], num_microbatches=n, clip_grad=clip, **KW)
    shards = opt.shards
    for minibatch in data(3, n):
        previous = [s.exp_avg.clone() for s in shards]
        opt.zero_grad()
        for x, y in minibatch:
            torch.nn.functional.mse_loss(model(x), y).backward()
        largest = opt.step()
        update = torch.cat([s.exp_avg - beta1 * b for s, b in zip(shards, previous)]).norm()
        assert largest > clip and update <= (1 - beta1) * clip * (1 + 1e-5)


def test_refusals_name_the_problem():
    model = make_model()
    opt = DistributedAdamA([{"params": list(model.parameters())}], num_microbatches=2, bucket_size=100, **KW)
    x, y = data(1, 1)[0][0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="cannot be discarded"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="middle of a mini-batch"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match="1 micro-batches were folded, but num_microbatches=2"):
        opt.step()
    saved = DistributedAdamA([{"params": list(make_model().parameters())}], bucket_size=100).state_dict()
    other = DistributedAdamA([{"params": list(make_model().parameters())}], bucket_size=None)
    with pytest.raises(ShardMismatch, match="--ddp-bucket-size it was saved with"):
        other.load_state_dict(saved)
    with pytest.raises(ShardMismatch, match="saved without --use-distributed-optimizer"):
        other.load_state_dict(AdamA(make_model().parameters()).state_dict())


def test_shards_round_trip_bit_for_bit():
    model, twin = make_model(torch.bfloat16), make_model(torch.bfloat16)
    opt = DistributedAdamA([{"params": list(model.parameters())}], num_microbatches=2, bucket_size=100, **KW)
    again = DistributedAdamA([{"params": list(twin.parameters())}], num_microbatches=2, bucket_size=100, **KW)
    train(model, opt, data(2, 2))
    again.load_state_dict(opt.state_dict())
    again.load_shard_state(opt.shard_state())
    for a, b in zip(opt.shards, again.shards):
        for key, tensor in a.state_tensors().items():
            assert torch.equal(tensor, b.state_tensors()[key])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))  # from the masters
    batches = data(2, 2)
    train(model, opt, batches)
    train(twin, again, batches)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
