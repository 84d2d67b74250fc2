"""Acceptance: a 14-op layer with 96 layers solves in under 0.5 s with every strategy. Asserted on CPU time (this
process's and a solver child's), which waiting for a core on a loaded machine does not inflate; the slowest
strategy takes about half the target on the 2-core CI machine, which leaves room for the cache and
memory-bandwidth contention that does inflate it. The wall-clock figure is what `adacc bench budget` reports."""

from __future__ import annotations

import os

import pytest

from megatron_adacc.adacc.policy.profile import analytic_profile
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, make_problem
from megatron_adacc.adacc.policy.strategies import solve

SIG = plain_signature(hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384, seq_length=2048,
                      micro_batch_size=1, dtype="bfloat16", num_layers=96, megatron_core_version="0.16.1")
TARGET_S = 0.5


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.mark.parametrize("chain_aware, heterogeneous", [(False, False), (True, False), (True, True)])
def test_14_ops_96_layers_solves_fast(chain_aware: bool, heterogeneous: bool) -> None:
    profile = analytic_profile(SIG)
    profile.segment_overhead_s = 1e-4
    probe = make_problem(profile, None, SolveOptions())
    lo = probe.min_feasible_budget(stash=True)
    hi = probe.fixed_bytes + SIG["num_layers"] * sum(cs[0].memory_bytes for cs in probe.choices)
    worst = 0.0
    for frac in (0.1, 0.35, 0.6, 0.85):
        problem = make_problem(profile, lo + frac * (hi - lo), SolveOptions())
        best = float("inf")
        for _ in range(2):
            t0 = _cpu_seconds()
            solve(problem, chain_aware=chain_aware, heterogeneous=heterogeneous)
            best = min(best, _cpu_seconds() - t0)
        worst = max(worst, best)
    print(f"chain_aware={chain_aware} heterogeneous={heterogeneous}: worst solve {worst * 1e3:.0f} ms of CPU")
    assert worst < TARGET_S
