"""Under torch.distributed, only rank 0 profiles and solves for ``auto``; every rank gets rank 0's result or failure."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_adacc.adacc.integration.auto import RankZeroRefusal, on_rank0
from megatron_adacc.adacc.policy import Policy
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError


def _worker(rank: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = []

    def solve() -> Policy:  # each rank would solve something else: rank 1 recomputes everything
        calls.append(rank)
        return Policy.all_keep(2) if rank == 0 else Policy.all_recompute(2)

    policy = on_rank0(solve)

    def refuse() -> Policy:
        raise InfeasibleBudgetError(1, 5_000_000)

    try:
        on_rank0(refuse)
        refusal = None
    except (InfeasibleBudgetError, RankZeroRefusal) as exc:
        refusal = (type(exc).__name__, str(exc))

    def crash() -> None:  # not a refusal: a bug on rank 0 must not leave rank 1 waiting either
        raise ZeroDivisionError("boom")

    try:
        on_rank0(crash)
        crashed = None
    except (ZeroDivisionError, RankZeroRefusal) as exc:
        crashed = (type(exc).__name__, str(exc))
    Path(results, f"rank{rank}").write_text(repr((policy.summary(), calls, refusal, crashed)))
    dist.destroy_process_group()


def test_rank0_solves_and_the_others_receive_its_policy_or_its_refusal():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(str(Path(tmp) / "store"), tmp), nprocs=2, join=True)
        found = [eval(Path(tmp, f"rank{r}").read_text()) for r in range(2)]  # noqa: S307 - our own repr
    (keep0, calls0, refusal0, crashed0), (keep1, calls1, refusal1, crashed1) = found
    assert keep0 == keep1 == Policy.all_keep(2).summary()
    assert calls0 == [0] and calls1 == []  # rank 1 never solved
    assert refusal0[0] == "InfeasibleBudgetError" and refusal1[0] == "RankZeroRefusal"
    assert refusal0[1] == refusal1[1] and "smallest feasible budget" in refusal1[1]
    assert crashed0 == ("ZeroDivisionError", "boom")
    assert crashed1 == ("RankZeroRefusal", "rank 0 failed: ZeroDivisionError: boom")


def test_a_world_of_one_just_solves():
    """No process group, or one of a single rank (other tests in this worker may have made one)."""
    assert on_rank0(lambda: Policy.all_recompute(1)).summary() == Policy.all_recompute(1).summary()
