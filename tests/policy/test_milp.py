"""The MILP strategies against exhaustive search, and the improvements against the paper's formulation."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_adacc.adacc.policy.cost_model import Choice, Problem, build_problem
from megatron_adacc.adacc.policy.pareto import pareto_front
from megatron_adacc.adacc.policy.policy import Decision
from megatron_adacc.adacc.policy.profile import analytic_profile
from megatron_adacc.adacc.policy.signature import plain_signature
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError, brute_force, chain_aware, heterogeneous, paper

SIG = plain_signature(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, seq_length=128,
                      micro_batch_size=2, dtype="float32", num_layers=12, megatron_core_version="0.16.1")


def random_problem(rng: random.Random, n_ops: int, n_layers: int, frac: float, *, per_tensor: bool = False,
                   remat: bool = False, runtime: bool = False, reads: bool = False) -> Problem:
    """Up to 3 choices per op: keep, compress (maybe), recompute (not for op 0). With ``remat``, compressed and
    recomputed ops re-materialize their bytes in backward, each op's forward holds some bytes, and there is a
    workspace, so the transient term (the largest of them) is part of every memory bound. With ``runtime``, every
    layer that does not keep everything pays a fixed runtime cost. With ``reads``, some ops read an output from
    past the op before them (a residual add, the attention's Q/K/V), so policies whose segments would split such a
    read are left out, and a segment holding such a reader holds that output (some of those ops have two outputs,
    one per reader)."""
    fwd = [rng.uniform(0.1, 5.0) for _ in range(n_ops)]
    read_pairs = tuple((p, r) for p in range(n_ops) for r in range(p + 2, n_ops) if reads and rng.random() < 0.3)
    if reads and not read_pairs:
        read_pairs = ((0, 2),)
    # an op read past the ops between may have two outputs, one the next op reads and one the later readers read
    # (the attention's q and k, and v): a segment holding only one of them holds that one only
    split = [any(p == i for p, _ in read_pairs) and rng.random() < 0.5 for i in range(n_ops)]
    choices = []
    for i in range(n_ops):
        m = float(rng.randint(1, 100))
        # some outputs are not saved for backward, so holding them for a recompute segment costs extra
        stash = tuple(float(rng.randint(1, 50)) if rng.random() < 0.3 else 0.0 for _ in range(1 + split[i]))
        cs = [Choice(Decision.keep(), m, 0.0, (), stash)]
        if i == 0 or rng.random() < 0.8:
            dc = rng.uniform(0.05, 2.0)
            cs.append(Choice(Decision.compress("int4_symmetric"), m * rng.uniform(0.1, 0.5),
                             dc + rng.uniform(0.05, 2.0), (dc,) * len(stash), tuple(x * 0.25 for x in stash),
                             m if remat else 0.0))
        if i > 0:
            cs.append(Choice(Decision.recompute(), 0.0, fwd[i], remat_bytes=m if remat else 0.0))
        choices.append(cs)
    outputs = None
    if reads:
        outputs = []
        for i in range(n_ops):
            size = max(c.remat_bytes for c in choices[i]) or 1.0
            later = frozenset(r for p, r in read_pairs if p == i)
            outputs.append(((frozenset({i + 1}), size / 2), (later, size / 2)) if split[i]
                           else ((frozenset({i + 1}) | later, size),))
    overhead = rng.uniform(0.0, 1.0)
    # a measured segment time that is neither additive nor monotone in the simple way
    seg = {(a, b): sum(fwd[a:b + 1]) * rng.uniform(0.7, 1.3) + overhead
           for a in range(n_ops) for b in range(a, n_ops)}
    # some ops draw random numbers: a segment containing one holds a copy of the RNG states
    problem = Problem(choices=choices, num_layers=n_layers, static_bytes=10.0, budget_bytes=None,
                      segment_time=lambda a, b: seg[(a, b)], per_tensor=per_tensor,
                      rng_bytes=float(rng.randint(0, 20)),
                      rng_ops=frozenset(i for i in range(n_ops) if rng.random() < 0.3),
                      workspace_bytes=float(rng.randint(0, 150)) if remat else 0.0,
                      runtime_overhead_s=rng.uniform(0.0, 3.0) if runtime else 0.0,
                      reads=read_pairs, outputs=outputs,
                      forward_bytes=[float(rng.randint(0, 80)) for _ in range(n_ops)] if remat else None)
    lo = problem.min_feasible_budget(stash=True)
    hi = problem.total_memory([[0] * n_ops] * n_layers, stash=True)
    problem.budget_bytes = lo + frac * max(hi - lo, 0.0)
    return problem


@pytest.mark.parametrize("seed", range(12))
def test_paper_and_chain_aware_equal_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    problem = random_problem(rng, n_ops=rng.randint(3, 8), n_layers=rng.randint(1, 6), frac=rng.random(),
                             per_tensor=seed % 2 == 1)
    for strategy, chain in ((paper, False), (chain_aware, True)):
        got = strategy.solve(problem)
        want = brute_force.solve(problem, chain_aware=chain)
        assert got.predicted_time_s == pytest.approx(want.predicted_time_s, rel=1e-6, abs=1e-9)
        assert problem.total_memory(got.layer_picks, stash=chain) <= problem.budget_bytes + 1e-6
        # the reported time is the cost model's own evaluation of the decisions
        assert got.predicted_time_s == pytest.approx(problem.total_time(got.layer_picks, chain_aware=chain))


@pytest.mark.parametrize("seed", range(12))
def test_transient_term_paper_and_chain_aware_equal_brute_force(seed: int) -> None:
    """With re-materialization and a workspace, the two linear bounds are exactly max(workspace, remat)."""
    rng = random.Random(300 + seed)
    problem = random_problem(rng, n_ops=rng.randint(3, 7), n_layers=rng.randint(1, 6), frac=rng.random(),
                             per_tensor=seed % 2 == 1, remat=True)
    for strategy, chain in ((paper, False), (chain_aware, True)):
        got = strategy.solve(problem)
        want = brute_force.solve(problem, chain_aware=chain)
        assert got.predicted_time_s == pytest.approx(want.predicted_time_s, rel=1e-6, abs=1e-9)
        assert problem.total_memory(got.layer_picks, stash=chain) <= problem.budget_bytes + 1e-6
    # heterogeneous layers never lose to the uniform chain-aware optimum, and fit
    het = heterogeneous.solve(problem, chain_aware=True)
    assert het.predicted_time_s <= chain_aware.solve(problem).predicted_time_s * (1 + 1e-9) + 1e-12
    assert het.predicted_memory_bytes <= problem.budget_bytes + 1e-6


@pytest.mark.parametrize("seed", range(12))
def test_no_strategy_splits_a_read_and_each_equals_brute_force_without_them(seed: int) -> None:
    """A segment reading an output another segment recomputes would re-run that segment at its own re-run (the
    runtime resolves the read through the other segment's token): every strategy leaves such policies out, and is
    still exact over the rest."""
    rng = random.Random(1200 + seed)
    problem = random_problem(rng, n_ops=rng.randint(4, 7), n_layers=rng.randint(1, 4), frac=rng.random(),
                             per_tensor=seed % 2 == 1, remat=True, reads=True)
    for strategy, chain in ((paper, False), (chain_aware, True)):
        got = strategy.solve(problem)
        want = brute_force.solve(problem, chain_aware=chain)
        assert got.predicted_time_s == pytest.approx(want.predicted_time_s, rel=1e-6, abs=1e-9)
        assert not any(problem.splits_a_read(p) for p in got.layer_picks)
    assert not any(problem.splits_a_read(p.picks) for p in pareto_front(problem, chain_aware=True))
    het = heterogeneous.solve(problem, chain_aware=True)
    assert not any(problem.splits_a_read(p) for p in het.layer_picks)


@pytest.mark.parametrize("seed", range(6))
def test_heterogeneous_layers_equal_brute_force_without_split_reads(seed: int) -> None:
    rng = random.Random(1300 + seed)
    problem = random_problem(rng, n_ops=4, n_layers=2, frac=rng.random(), remat=True, reads=True)
    want, _ = brute_force_ordered(problem, True)
    if want < float("inf"):
        got = heterogeneous.solve(problem, chain_aware=True, time_limit_s=None)
        assert got.predicted_time_s == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_a_segment_that_reads_what_another_recomputes_re_runs_it_at_its_own_re_run() -> None:
    """Ops 0..4, op 3 reading op 1's output past op 2: with ops 1 and 3 recomputed and op 2 kept, the segment of
    op 1 re-runs when op 3's does (at stage 4, op 3's reader), not at stage 2 where its own reader runs, and its
    bytes are live from there down to stage 2."""
    choices = [[Choice(Decision.keep(), 10.0, 0.0)]] + [
        [Choice(Decision.keep(), 10.0 * (i + 1), 0.0),
         Choice(Decision.recompute(), 0.0, 1.0, remat_bytes=10.0 * (i + 1))] for i in range(1, 5)]
    problem = Problem(choices=choices, num_layers=1, static_bytes=0.0, budget_bytes=None,
                      segment_time=lambda a, b: float(b - a + 1), reads=((1, 3),))
    split = [0, 1, 0, 1, 0]
    assert problem.splits_a_read(split) and not problem.splits_a_read([0, 1, 1, 1, 0])
    assert not problem.splits_a_read([0, 0, 0, 1, 0]) and not problem.splits_a_read([0, 1, 0, 0, 0])
    stages = problem.stage_bytes(split)
    # stored: op 0 (10, live down to its reader's stage 1), op 2 (30, down to 3), op 4 (50, its own stage 4);
    # op 1's 20 bytes, re-run with op 3's segment, live at stages 4..2 (down to its reader); op 3's 40 at 4
    assert stages == [0.0, 10.0, 10.0 + 20.0, 10.0 + 30.0 + 20.0, 10.0 + 30.0 + 20.0 + 40.0 + 50.0]
    problem.reads = ()  # as the model had it: op 1's segment re-run only at its own reader's stage 2
    assert problem.stage_bytes(split) == [0.0, 10.0, 10.0 + 20.0, 10.0 + 30.0, 10.0 + 30.0 + 40.0 + 50.0]


@pytest.mark.parametrize("seed", range(8))
def test_min_feasible_budget_is_the_least_memory_of_any_policy(seed: int) -> None:
    rng = random.Random(400 + seed)
    problem = random_problem(rng, n_ops=rng.randint(2, 6), n_layers=rng.randint(1, 5), frac=0.0, remat=True)
    for stash in (False, True):
        least = min(problem.total_memory([p] * problem.num_layers, stash=stash)
                    for p in itertools.product(*(range(len(cs)) for cs in problem.choices)))
        assert problem.min_feasible_budget(stash=stash) == math.ceil(least)


def brute_force_heterogeneous(problem: Problem, chain_aware: bool) -> float:
    """Best total time over every multiset of per-layer policies (layers are interchangeable)."""
    layer_policies = [(problem.layer_memory(p, stash=chain_aware), problem.layer_time(p, chain_aware=chain_aware))
                      for p in itertools.product(*(range(len(cs)) for cs in problem.choices))
                      if not problem.splits_a_read(p)]
    best = float("inf")
    for combo in itertools.combinations_with_replacement(range(len(layer_policies)), problem.num_layers):
        mem = problem.fixed_bytes + sum(layer_policies[i][0] for i in combo)
        if mem <= problem.budget_bytes:
            best = min(best, sum(layer_policies[i][1] for i in combo))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_heterogeneous_equals_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    problem = random_problem(rng, n_ops=rng.randint(2, 4), n_layers=rng.randint(2, 3), frac=rng.random())
    for chain in (False, True):
        got = heterogeneous.solve(problem, chain_aware=chain, time_limit_s=None)
        assert got.predicted_time_s == pytest.approx(brute_force_heterogeneous(problem, chain), rel=1e-6, abs=1e-9)
        assert got.predicted_memory_bytes <= problem.budget_bytes


def brute_force_ordered(problem: Problem, chain_aware: bool) -> tuple[float, float]:
    """Best total time over every multiset of layer policies, the leaner ones in the lower layers (as the
    heterogeneous strategy places them), under the exact bound: each layer's backward beside what the layers
    below it still hold (infinite when nothing fits); and the least memory of any of them."""
    policies = sorted((p for p in itertools.product(*(range(len(cs)) for cs in problem.choices))
                       if not problem.splits_a_read(p)), key=lambda p: problem.layer_memory(p, stash=chain_aware))
    best, least = float("inf"), float("inf")
    for combo in itertools.combinations_with_replacement(range(len(policies)), problem.num_layers):
        layers = [policies[i] for i in combo]  # combo ascends: leaner first
        memory = problem.total_memory(layers, stash=chain_aware)
        least = min(least, memory)
        if memory <= problem.budget_bytes:
            best = min(best, problem.total_time(layers, chain_aware=chain_aware))
    return best, least


@pytest.mark.parametrize("seed", range(12))
def test_two_layers_with_backward_transients_equal_brute_force_under_the_exact_bound(seed: int) -> None:
    """Budgets from below the uniform floor up: a mix of two policies is exact under the ordered bound."""
    rng = random.Random(900 + seed)
    problem = random_problem(rng, n_ops=rng.randint(2, 4), n_layers=2, frac=0.0, remat=True)
    lo = problem.min_feasible_budget(stash=True)
    hi = problem.total_memory([[0] * problem.num_ops] * 2, stash=True)
    problem.budget_bytes = lo + rng.uniform(-0.15, 0.6) * (hi - lo)
    for chain in (False, True):
        want, least = brute_force_ordered(problem, chain)
        assert problem.min_feasible_budget(stash=chain, heterogeneous=True) == math.ceil(least)
        if want == float("inf"):
            with pytest.raises(InfeasibleBudgetError, match=f"{math.ceil(least):,}"):
                heterogeneous.solve(problem, chain_aware=chain, time_limit_s=None)
            continue
        got = heterogeneous.solve(problem, chain_aware=chain, time_limit_s=None)
        assert got.predicted_time_s == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert got.predicted_memory_bytes <= problem.budget_bytes


def test_a_lean_layer_below_is_charged_its_rematerialization_beside_the_layers_below_only() -> None:
    """Op 1 kept stores 100 bytes; recomputed it stores nothing and re-materializes 100 in its backward. The
    bottom layer's backward runs last, when the top layer has freed what it stored: recompute below, keep above
    peaks at 10 + 100 (the bottom layer's stage), not 10 + 110 + 100."""
    keep, rec = Decision.keep(), Decision.recompute()
    choices = [[Choice(keep, 10, 0.0)], [Choice(keep, 100, 0.0), Choice(rec, 0, 1.0, remat_bytes=100)]]
    problem = Problem(choices=choices, num_layers=2, static_bytes=0.0, budget_bytes=125,
                      segment_time=lambda a, b: 1.0)
    assert problem.total_memory([[0, 1], [0, 0]]) == 120  # the start of backward: 10 + 110
    assert problem.total_memory([[0, 0], [0, 1]]) == 220  # the other way round, the whole model beside it
    assert problem.min_feasible_budget() == 120  # recompute in both layers: 20 + 100
    assert problem.min_feasible_budget(heterogeneous=True) == 120  # the mix ties it
    got = heterogeneous.solve(problem, chain_aware=True, time_limit_s=None)
    assert got.layer_picks == [[0, 1], [0, 0]] and got.predicted_time_s == 1.0
    assert got.predicted_memory_bytes == 120


@pytest.mark.parametrize("seed", range(10))
def test_runtime_overhead_strategies_equal_brute_force(seed: int) -> None:
    """The runtime's fixed per-layer cost (which keep-everything layers escape) is outside the MILP objectives:
    the uniform strategies and the Pareto front must still reach the exhaustive optimum."""
    rng = random.Random(500 + seed)
    problem = random_problem(rng, n_ops=rng.randint(2, 4), n_layers=rng.randint(2, 3), frac=rng.uniform(0.5, 1.0),
                             runtime=True, remat=seed % 2 == 1)
    assert problem.runtime_overhead_s > 0
    for strategy, chain in ((paper, False), (chain_aware, True)):
        got = strategy.solve(problem)
        want = brute_force.solve(problem, chain_aware=chain)
        assert got.predicted_time_s == pytest.approx(want.predicted_time_s, rel=1e-6, abs=1e-9)
    if seed % 2 == 0:  # brute_force_heterogeneous has no transient term
        for chain in (False, True):
            got = heterogeneous.solve(problem, chain_aware=chain, time_limit_s=None)
            assert got.predicted_time_s == pytest.approx(brute_force_heterogeneous(problem, chain), rel=1e-6,
                                                         abs=1e-9)


def test_a_costly_runtime_keeps_most_layers_on_the_stock_forward() -> None:
    """Just under the keep-everything memory, a large fixed runtime cost makes one layer give up more rather
    than every layer a little (what Megatron's block recompute of one layer does)."""
    keep, comp, rec = Decision.keep(), Decision.compress("int4_symmetric"), Decision.recompute()
    choices = [[Choice(keep, 100, 0.0), Choice(comp, 30, 1.0, (0.5,))],
               [Choice(keep, 10, 0.0), Choice(comp, 3, 0.1, (0.05,)), Choice(rec, 0, 0.2)]]
    problem = Problem(choices=choices, num_layers=4, static_bytes=0.0, budget_bytes=4 * 110 - 20,
                      segment_time=lambda a, b: 0.2, runtime_overhead_s=5.0)
    got = heterogeneous.solve(problem, chain_aware=True, time_limit_s=None)
    stock = [p for p in got.layer_picks if problem.is_stock(p)]
    assert len(stock) == 3 and got.predicted_time_s == pytest.approx(5.0 + 1.0)  # one layer compresses op 0
    assert got.predicted_time_s == pytest.approx(brute_force_heterogeneous(problem, True))
    # without the fixed cost, compressing op 1 in three layers is cheaper (3 x 0.1 < 1.0)
    problem.runtime_overhead_s = 0.0
    got = heterogeneous.solve(problem, chain_aware=True, time_limit_s=None)
    assert got.predicted_time_s == pytest.approx(0.3) and sum(problem.is_stock(p) for p in got.layer_picks) == 1


@pytest.mark.parametrize("seed", range(10))
def test_improvements_never_worse_than_paper(seed: int) -> None:
    """Under the chain-aware cost model, every improved formulation beats or ties the paper's policy."""
    rng = random.Random(200 + seed)
    problem = random_problem(rng, n_ops=8, n_layers=rng.randint(2, 12), frac=rng.random())
    paper_res = paper.solve(problem)
    paper_true = problem.total_time(paper_res.layer_picks, chain_aware=True)
    ca = chain_aware.solve(problem)
    het = heterogeneous.solve(problem, chain_aware=False)
    het_ca = heterogeneous.solve(problem, chain_aware=True)
    eps = 1e-9 * max(1.0, paper_true)
    # when the paper's policy really fits (eq. 8 ignores segment-input stashes), it is in the chain-aware
    # feasible set, so the chain-aware optimum cannot be slower
    if problem.total_memory(paper_res.layer_picks, stash=True) <= problem.budget_bytes:
        assert ca.predicted_time_s <= paper_true + eps
    assert het_ca.predicted_time_s <= ca.predicted_time_s + eps
    # heterogeneous under the paper's own cost model beats the paper's uniform optimum
    assert het.predicted_time_s <= paper_res.predicted_time_s + 1e-9 * max(1.0, paper_res.predicted_time_s)


def test_improvements_never_worse_on_a_gpt_profile_at_many_budgets() -> None:
    prof = analytic_profile(SIG)
    prof.segment_overhead_s = 1e-3
    probe = build_problem(prof, None)
    lo = probe.min_feasible_budget()
    hi = probe.fixed_bytes + SIG["num_layers"] * sum(cs[0].memory_bytes for cs in probe.choices)
    for frac in (0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 1.0):
        problem = build_problem(prof, lo + frac * (hi - lo), codecs="all")
        base = problem.total_time(paper.solve(problem).layer_picks, chain_aware=True)
        best = heterogeneous.solve(problem, chain_aware=True)
        assert best.predicted_time_s <= base * (1 + 1e-9) + 1e-12
        assert best.predicted_memory_bytes <= problem.budget_bytes


def test_pareto_front_is_nondominated_and_complete() -> None:
    rng = random.Random(7)
    problem = random_problem(rng, n_ops=6, n_layers=1, frac=1.0)
    for chain in (False, True):
        front = pareto_front(problem, chain_aware=chain)
        pts = [(problem.layer_memory(p, stash=chain), problem.layer_time(p, chain_aware=chain))
               for p in itertools.product(*(range(len(cs)) for cs in problem.choices))]
        for fp in front:
            # the DP's bookkeeping matches the cost model
            assert fp.memory_bytes == pytest.approx(problem.layer_memory(fp.picks, stash=chain))
            assert fp.time_s == pytest.approx(problem.layer_time(fp.picks, chain_aware=chain))
            assert not any(m <= fp.memory_bytes and t < fp.time_s - 1e-12 and (m, t) != (fp.memory_bytes, fp.time_s)
                           for m, t in pts if m < fp.memory_bytes or t < fp.time_s - 1e-12)
        # every policy is dominated by (or equal to) a front point
        for m, t in pts:
            assert any(fp.memory_bytes <= m + 1e-9 and fp.time_s <= t + 1e-9 for fp in front)


def test_infeasible_budget_names_the_smallest_feasible_budget() -> None:
    prof = analytic_profile(SIG)
    # the chain-aware model (and heterogeneous, chain-aware by default) also counts segment inputs
    for strategy, chain in ((paper.solve, False), (chain_aware.solve, True), (heterogeneous.solve, True)):
        need = build_problem(prof, None).min_feasible_budget(stash=chain, heterogeneous=strategy is heterogeneous.solve)
        with pytest.raises(InfeasibleBudgetError, match=f"{need:,}") as info:
            strategy(build_problem(prof, need - 1000))
        assert info.value.min_feasible_bytes == need
        # exactly the smallest feasible budget is feasible
        assert strategy(build_problem(prof, need)).predicted_memory_bytes <= need


def test_first_op_is_never_recomputed_and_unbounded_budget_keeps_everything() -> None:
    prof = analytic_profile(SIG)
    tight = build_problem(prof, build_problem(prof, None).min_feasible_budget(stash=True))
    res = heterogeneous.solve(tight)
    assert all(layer[0].action != "recompute" for layer in res.decisions)
    free = paper.solve(build_problem(prof, None))
    assert all(d.action == "keep" for layer in free.decisions for d in layer)
    assert free.predicted_time_s == 0.0


@pytest.mark.parametrize("frac", [0.0, 0.3])
def test_the_layer_input_checkpoint_against_brute_force(frac: float) -> None:
    """The layer's own ops, the checkpoint first: the layer input kept or compressed, the other ops kept or
    recomputed, the attention's scores, softmax and dropout recomputed (2,048 policies, few enough to enumerate).
    The MILPs find brute force's optimum, and at the smallest budget it compresses the input and recomputes
    input_layernorm, which eq. 6's op order could not."""
    prof = analytic_profile(SIG)

    def allow(op: str, d: Decision) -> bool:
        if op in ("scores", "softmax", "dropout"):
            return d.action == "recompute"
        return d.action != "compress" or op == "layer_input"

    probe = build_problem(prof, None, allow=allow)
    lo = probe.min_feasible_budget(stash=True)
    hi = probe.total_memory([[0] * probe.num_ops] * probe.num_layers, stash=True)
    problem = build_problem(prof, lo + frac * (hi - lo), allow=allow)
    for strategy, chain in ((paper, False), (chain_aware, True)):
        if not chain and frac == 0.0:
            continue  # the paper's memory model does not count segment inputs: its least budget differs
        got, want = strategy.solve(problem), brute_force.solve(problem, chain_aware=chain)
        assert got.predicted_time_s == pytest.approx(want.predicted_time_s, rel=1e-6, abs=1e-9)
    if frac == 0.0:
        least = chain_aware.solve(problem).decisions[0]
        assert (least[0].action, least[1].action) == ("compress", "recompute")


def test_sdpa_profiles_charge_rng_states_to_context() -> None:
    """The SDPA kernel draws attention dropout inside context: a profile of such a layer puts the RNG states on the
    segments that recompute context, not dropout (an empty op there), as the runtime holds them."""
    for attention, drawing in (("unfused", ["dropout", "self_attn_bda", "mlp_bda"]),
                               ("sdpa", ["context", "self_attn_bda", "mlp_bda"])):
        problem = build_problem(analytic_profile({**SIG, "attention": attention}), None)
        assert [problem.op_names[i] for i in sorted(problem.rng_ops)] == drawing


def test_hand_computed_two_op_instance() -> None:
    # op0: keep 10 B | compress 3 B at 1 s; op1: keep 20 B | recompute at 2 s. Budget 25 B, no static.
    problem = Problem(
        choices=[[Choice(Decision.keep(), 10, 0), Choice(Decision.compress("int4_outlier"), 3, 1, (0.5,))],
                 [Choice(Decision.keep(), 20, 0), Choice(Decision.recompute(), 0, 2)]],
        num_layers=1, static_bytes=0, budget_bytes=25, segment_time=lambda a, b: 2.0,
        op_names=["input_layernorm", "linear_qkv"])
    # keep+keep = 30 B (too big); compress+keep = 23 B at 1 s; keep+recompute = 10 B at 2 s
    res = paper.solve(problem)
    assert res.layer_picks == [[1, 0]] and res.predicted_time_s == 1.0
    # chain-aware adds the re-decompression of a compressed segment input: compress+recompute = 1+2+0.5
    problem.budget_bytes = 12
    assert chain_aware.solve(problem).predicted_time_s == 2.0  # keep + recompute


def test_headroom_keeps_a_fraction_of_the_budget_free_and_names_the_budget_it_needs() -> None:
    from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy

    prof = analytic_profile(SIG)
    probe = build_problem(prof, None)
    lo = probe.min_feasible_budget(stash=True, heterogeneous=True)  # SolveOptions' default strategy's floor
    budget = lo + 0.5 * (probe.total_memory([[0] * probe.num_ops] * probe.num_layers, stash=True) - lo)
    policy, result = solve_policy(prof, budget, SolveOptions(headroom=0.1))
    assert result.predicted_memory_bytes <= 0.9 * budget
    assert policy.budget_bytes == int(budget)  # the policy records the budget it was asked for
    with pytest.raises(InfeasibleBudgetError, match="headroom") as info:
        solve_policy(prof, lo, SolveOptions(headroom=0.1))
    assert info.value.min_feasible_bytes == math.ceil(lo / 0.9)
    with pytest.raises(ValueError, match="fraction"):
        solve_policy(prof, budget, SolveOptions(headroom=1.5))


def test_headroom_has_a_floor_in_bytes_unless_the_run_names_a_fraction() -> None:
    """What the cost model does not see is partly a fixed amount, so a small budget keeps at least
    HEADROOM_FLOOR_BYTES free by default; an explicit --adacc-memory-headroom is taken as it is."""
    from types import SimpleNamespace

    from megatron_adacc.adacc.policy.solver import HEADROOM_FLOOR_BYTES, SolveOptions, solve_policy

    default = SolveOptions.from_args(SimpleNamespace(adacc_memory_headroom=None))
    assert (default.headroom, default.headroom_min_bytes) == (0.01, HEADROOM_FLOOR_BYTES)
    assert default.usable_bytes(400 * 2**20) == 392 * 2**20  # 1% would be 4 MiB
    assert default.usable_bytes(2**30) == 0.99 * 2**30  # from 800 MiB up the fraction is larger
    named = SolveOptions.from_args(SimpleNamespace(adacc_memory_headroom=0.01))
    assert named.headroom_min_bytes == 0 and named.usable_bytes(400 * 2**20) == 0.99 * 400 * 2**20

    prof = analytic_profile(SIG)
    probe = build_problem(prof, None)
    lo = probe.min_feasible_budget(stash=True, heterogeneous=True)
    hi = probe.total_memory([[0] * probe.num_ops] * probe.num_layers, stash=True)
    floor = 0.25 * (hi - lo)
    options = SolveOptions(headroom=0.01, headroom_min_bytes=floor)
    _, result = solve_policy(prof, hi, options)
    assert result.predicted_memory_bytes <= hi - floor
    with pytest.raises(InfeasibleBudgetError, match="at least") as info:
        solve_policy(prof, lo + floor / 2, options)
    assert info.value.min_feasible_bytes == math.ceil(lo + floor)


def test_no_outlier_separation_swaps_outlier_int4_for_per_token_int4_and_nothing_else() -> None:
    """The paper's "Adacc w/o outlier" ablation: the same MILP, with plain per-token INT4 offered wherever the
    layer-specific codec is outlier-separated INT4."""
    from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy

    prof = analytic_profile(SIG)
    probe = build_problem(prof, None)
    lo = probe.min_feasible_budget(stash=True)
    budget = lo + 0.1 * (probe.total_memory([[0] * probe.num_ops] * probe.num_layers, stash=True) - lo)
    with_sep, _ = solve_policy(prof, budget, SolveOptions(headroom=0.0))
    without, _ = solve_policy(prof, budget, SolveOptions(headroom=0.0, outlier_separation=False))
    codecs = lambda pol: {d.codec for layer in pol.layers for d in layer if d.codec}  # noqa: E731
    assert "int4_outlier" in codecs(with_sep)
    assert "int4_outlier" not in codecs(without) and "int4_symmetric" in codecs(without)
    # the MILP is offered the same choices but for that one swap (the optimum may move elsewhere too)
    offered = lambda problem: [[c.decision.label for c in cs] for cs in problem.choices]  # noqa: E731
    swapped = [[label.replace("int4_outlier", "int4_symmetric") for label in op] for op in offered(probe)]
    assert offered(build_problem(prof, None, codec_substitutes={"int4_outlier": "int4_symmetric"})) == swapped


def test_an_infinite_outlier_z_is_refused_with_the_flag_that_does_what_it_meant() -> None:
    import argparse

    from megatron_adacc.arguments import add_adacc_args

    parser = add_adacc_args(argparse.ArgumentParser(exit_on_error=False))
    with pytest.raises(argparse.ArgumentError, match="--adacc-no-outlier-separation"):
        parser.parse_args(["--adacc-outlier-z", "inf"])
    assert parser.parse_args(["--adacc-no-outlier-separation"]).adacc_no_outlier_separation


def test_the_backward_bound_walks_the_stages_and_transients_at_different_stages_do_not_add_up() -> None:
    """Issue 18, item 1: a recompute segment of the MLP (live while the MLP's backward runs) and a decompressed
    attention tensor (live later, in the attention's backward) are never live together, so the layer's peak is
    the larger of the two, not their sum. Each stage holds the gradients of its op, what the layer stored and
    autograd has not freed yet, and what that stage re-materializes."""
    prof = analytic_profile(SIG)
    problem = build_problem(prof, None)
    n, saved = problem.num_ops, [op.saved_bytes for op in prof.ops]
    idx = {op.name: i for i, op in enumerate(prof.ops)}

    def picks(**actions: str) -> list[int]:
        return [next(k for k, c in enumerate(cs) if c.decision.action == actions.get(op.name, "keep"))
                for op, cs in zip(prof.ops, problem.choices)]

    keep = picks()
    # keep-everything: a stage still holds the bytes whose reader has not run; the next op reads each here
    expected = [sum(saved[k] for k in range(n) if min(k + 1, n - 1) <= s) for s in range(n)]
    assert problem.stage_bytes(keep) == expected and problem.layer_excess(keep) == 0

    mlp = picks(linear_fc1="recompute", activation="recompute", dropout="compress")
    stages = problem.stage_bytes(mlp)
    fc1, act, drop, fc2 = idx["linear_fc1"], idx["activation"], idx["dropout"], idx["linear_fc2"]
    held = problem.layer_memory(mlp)

    def held_at(s: int) -> float:  # what the ops read at or before stage s still hold
        return sum(problem.choices[k][p].memory_bytes for k, p in enumerate(mlp) if min(k + 1, n - 1) <= s)

    # the segment re-runs at linear_fc2's backward (its reader) and both values are live there ...
    assert stages[fc2] == held_at(fc2) + saved[fc1] + saved[act]
    # ... the decompressed dropout output is live in the backward of context, its reader, with the segment gone
    assert stages[drop + 1] == held_at(drop + 1) + saved[drop]
    peak = max(stages)
    assert problem.layer_excess(mlp) == peak - held < saved[fc1] + saved[act] + saved[drop]
    # and the whole model: every layer's stored bytes, with the larger of the workspace and that excess
    layers = [mlp] * problem.num_layers
    assert problem.total_memory(layers) == (problem.fixed_bytes + problem.num_layers * held
                                            + max(problem.workspace_bytes, peak - held))


def test_the_milps_bound_every_stage_exactly_as_the_cost_model_does() -> None:
    """The per-stage constraints of both uniform MILPs are the cost model's, linear: at budgets between the
    leanest and the richest policy each solution's exact peak fits, and brute force over all uniform policies
    finds nothing faster (a 6-op problem with readers further away than the next op and gradients)."""
    saved = [40.0, 90.0, 30.0, 120.0, 60.0, 50.0]
    n = len(saved)
    choices = []
    for i, m in enumerate(saved):
        cs = [Choice(Decision.keep(), m, 0.0), Choice(Decision.compress("int4_symmetric"), m / 4, m / 100.0,
                                                      (m / 300.0,), (), m)]
        if i:
            cs.append(Choice(Decision.recompute(), 0.0, m / 60.0, remat_bytes=m))
        choices.append(cs)
    consumers = [{1: 40.0}, {2: 60.0, 3: 30.0}, {2: 10.0, 3: 30.0}, {4: 120.0}, {5: 60.0}, {5: 50.0}]
    grads = [10.0, 30.0, 20.0, 40.0, 25.0, 15.0]
    for budget_fraction in (0.15, 0.4, 0.7):
        problem = Problem(choices=choices, num_layers=3, static_bytes=5.0, budget_bytes=None,
                          segment_time=lambda a, b: 0.0, workspace_bytes=70.0, consumers=consumers, grad_bytes=grads,
                          op_names=[f"op{i}" for i in range(n)])
        lo, hi = problem.min_feasible_budget(), problem.total_memory([[0] * n] * 3)
        problem.budget_bytes = lo + budget_fraction * (hi - lo)
        for strategy, chain in ((paper, False), (chain_aware, True)):
            got = strategy.solve(problem)
            best = brute_force.solve(problem, chain_aware=chain)
            assert got.predicted_memory_bytes <= problem.budget_bytes
            assert got.predicted_time_s == pytest.approx(best.predicted_time_s, abs=1e-12), (strategy.NAME,
                                                                                              budget_fraction)
            # the Pareto front holds the uniform optimum, so mixing layers is never slower
            mixed = heterogeneous.solve(problem, chain_aware=chain, time_limit_s=None)
            assert mixed.predicted_memory_bytes <= problem.budget_bytes
            assert mixed.predicted_time_s <= best.predicted_time_s + 1e-12
    # and its leanest point is the smallest budget any uniform policy fits
    every = list(itertools.product(*(range(len(cs)) for cs in problem.choices)))
    for chain in (False, True):
        assert problem.min_feasible_budget(stash=chain) == math.ceil(
            min(problem.total_memory([p] * 3, stash=chain) for p in every))


def test_a_pulp_without_any_solver_is_refused_with_the_fix(monkeypatch):
    """PuLP 4 (what pip picks on Python 3.12) no longer bundles CBC; without highspy there is no backend."""
    import pulp

    from megatron_adacc.adacc.policy.strategies.base import SolverUnavailable
    from megatron_adacc.core.errors import AdaccError

    monkeypatch.delenv("ADACC_MILP_SOLVER", raising=False)
    for name in ("PULP_CBC_CMD", "COIN_CMD", "HiGHS"):
        monkeypatch.delattr(pulp, name, raising=False)
    with pytest.raises(SolverUnavailable, match=r"pip install highspy") as err:
        paper.solve(random_problem(random.Random(0), 3, 2, 0.5))
    assert isinstance(err.value, AdaccError)


def test_codec_none_keeps_or_recomputes_and_never_compresses() -> None:
    """``--adacc-codec none``: the same MILP without compression. Where compression was chosen, the lossless
    policy recomputes instead (it still fits the budget), and its predicted overhead is at least as large."""
    from megatron_adacc.adacc.policy.ops import Action
    from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy

    prof = analytic_profile(SIG)
    probe = build_problem(prof, None)
    lo = probe.min_feasible_budget(stash=True)
    budget = lo + 0.3 * (probe.total_memory([[0] * probe.num_ops] * probe.num_layers, stash=True) - lo)
    lossy, lossy_result = solve_policy(prof, budget, SolveOptions(headroom=0.0))
    lossless, lossless_result = solve_policy(prof, budget, SolveOptions(headroom=0.0, codec_family="none"))
    assert lossy.counts()[Action.COMPRESS] > 0
    counts = lossless.counts()
    assert counts[Action.COMPRESS] == 0 and counts[Action.KEEP] > 0 and counts[Action.RECOMPUTE] > 0
    assert lossless_result.predicted_memory_bytes <= budget
    assert lossless_result.predicted_time_s >= lossy_result.predicted_time_s
    assert lossless.summary() == f"{counts[Action.KEEP]} keep, {counts[Action.RECOMPUTE]} recompute"
    with pytest.raises(ValueError, match="int4, gact, none"):
        solve_policy(prof, budget, SolveOptions(codec_family="fp8"))
