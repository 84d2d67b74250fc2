"""Recompute segments: the one definition (``segments``), the MILPs' enumeration of them
(``candidate_segments``), and the cost model that charges them."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_adacc.adacc.policy.cost_model import Choice, Problem
from megatron_adacc.adacc.policy.ops import candidate_segments, segments
from megatron_adacc.adacc.policy.policy import Decision

K, R = False, True  # kept (or compressed) / recomputed


@pytest.mark.parametrize(("flags", "expected"), [
    ([], []),
    ([K, K, K], []),                                    # nothing recomputed
    ([R, R, R], [range(0, 3)]),                         # everything: one segment, from the layer's input
    ([R, K, K], [range(0, 1)]),                         # a run at the start
    ([K, K, R], [range(2, 3)]),                         # a run at the end
    ([K, R, R, K, R, K, R, R], [range(1, 3), range(4, 5), range(6, 8)]),
    ([K, R, K, R], [range(1, 2), range(3, 4)]),         # one stored op between two runs splits them
])
def test_segments_are_the_maximal_recomputed_runs(flags: list[bool], expected: list[range]) -> None:
    assert segments(flags) == expected


def test_segments_take_any_iterable_of_truthy_flags() -> None:
    decisions = [Decision.keep(), Decision.recompute(), Decision.recompute(), Decision.compress("int4_symmetric")]
    assert segments(d.action == "recompute" for d in decisions) == [range(1, 3)]
    assert segments([0, 1, 1, 0, 2]) == [range(1, 3), range(4, 5)]


def test_segments_cover_exactly_the_recomputed_ops() -> None:
    for flags in itertools.product([K, R], repeat=7):
        found = segments(flags)
        assert [i for seg in found for i in seg] == [i for i, f in enumerate(flags) if f]
        # maximal: the op before and the op after each segment are stored (or beyond the layer)
        for seg in found:
            assert seg and (seg.start == 0 or not flags[seg.start - 1])
            assert seg.stop == len(flags) or not flags[seg.stop]


@pytest.mark.parametrize(("recomputable", "start", "expected"), [
    ([K, R, R, R], 1, [range(1, 1), range(1, 2), range(1, 3), range(1, 4)]),  # up to the layer's end
    ([K, R, K, R], 1, [range(1, 1), range(1, 2)]),   # op 2 cannot be recomputed: it is stored, nothing beyond
    ([K, K, R], 1, [range(1, 1)]),                   # op 1 cannot be recomputed: only the empty segment
    ([K, R, R], 3, [range(3, 3)]),                   # after the last op: the empty segment to the sink
])
def test_candidate_segments(recomputable: list[bool], start: int, expected: list[range]) -> None:
    assert list(candidate_segments(recomputable, start)) == expected


def _walk(recomputable: list[bool], stored: int = 0, flags: tuple[bool, ...] = (K,),
          segs: tuple[range, ...] = ()) -> list[tuple[tuple[bool, ...], tuple[range, ...]]]:
    """Every (recompute pattern, segments on the way) the enumeration reaches from stored op ``stored`` on."""
    out = []
    for seg in candidate_segments(recomputable, stored + 1):
        now, path = flags + (R,) * len(seg), segs + ((seg,) if seg else ())
        if seg.stop == len(recomputable):
            out.append((now, path))
        else:
            out.extend(_walk(recomputable, seg.stop, now + (K,), path))
    return out


def test_candidates_reach_every_policy_once_and_end_in_its_segments() -> None:
    """Walking stored op -> candidate segment -> next stored op from op 0 enumerates every recompute pattern
    exactly once, and the segments on the way are what ``segments`` finds in that pattern."""
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 8)
        recomputable = [False] + [rng.random() < 0.7 for _ in range(n - 1)]
        found = _walk(recomputable)
        for flags, path in found:
            assert segments(flags) == list(path)
        patterns = [flags for flags, _ in found]
        every = [f for f in itertools.product([K, R], repeat=n) if all(recomputable[i] or not f[i] for i in range(n))]
        assert sorted(patterns) == sorted(every) and len(set(patterns)) == len(patterns)


# ----------------------------------------------------------------------------------------- cost model
def _problem(memory: list[float]) -> Problem:
    """One choice list per op: keep (``memory[i]`` bytes, a stash of 3 when it feeds a segment) and, but for
    op 0, recompute; op 2 draws random numbers. Segment a..b takes ``10 * (b - a + 1) + 1`` seconds."""
    choices = []
    for i, m in enumerate(memory):
        cs = [Choice(Decision.keep(), m, 0.0, stash=(3.0,))]
        if i:
            cs.append(Choice(Decision.recompute(), 0.0, 10.0, remat_bytes=m))
        choices.append(cs)
    return Problem(choices=choices, num_layers=1, static_bytes=0.0, budget_bytes=None,
                   segment_time=lambda a, b: 10.0 * (b - a + 1) + 1.0, rng_bytes=100.0, rng_ops=frozenset({2}))


def test_a_kept_op_that_stores_nothing_still_splits_segments() -> None:
    """Op 2 stores no byte when kept, yet recomputing ops 1 and 3 around it makes two segments, each re-run
    on its own and each holding its stored input; recomputing op 2 as well joins them into one segment, which
    also holds the RNG states op 2 draws from."""
    problem = _problem([8.0, 5.0, 0.0, 7.0])
    split = [0, 1, 0, 1]
    assert problem.layer_memory(split, stash=True) == 8.0 + 0.0 + 2 * 3.0
    assert problem.layer_time(split, chain_aware=True) == 2 * 11.0  # two launches
    joined = [0, 1, 1, 1]  # op 2 recomputed too: one segment, holding the RNG states
    assert problem.layer_memory(joined, stash=True) == 8.0 + 3.0 + 100.0
    assert problem.layer_time(joined, chain_aware=True) == 31.0


def test_a_recomputed_op_that_stores_nothing_stays_in_its_segment() -> None:
    problem = _problem([8.0, 5.0, 0.0, 7.0])
    # the segment re-runs at op 3's backward and holds ops 1 and 3 there, beside op 0's 8 bytes
    assert problem.stage_bytes([0, 1, 1, 1]) == [0.0, 8.0, 13.0, 20.0]
    assert problem.layer_excess([0, 1, 1, 1]) == 12.0
    assert problem.layer_time([0, 1, 1, 1], chain_aware=True) == problem.segment_cost(1, 3, {0: problem.choices[0][0]})


def test_cost_model_charges_the_segments_it_is_given() -> None:
    """Chain-aware time and stashed memory are the per-op terms plus one term per segment of ``segments``."""
    rng = random.Random(1)
    problem = _problem([float(rng.randint(0, 9)) for _ in range(7)])
    for picks in itertools.product(*[range(len(cs)) for cs in problem.choices]):
        chosen = [problem.choices[i][k] for i, k in enumerate(picks)]
        segs = segments(c.is_recompute for c in chosen)
        stored = [c for c in chosen if not c.is_recompute]
        time = sum(c.time_s for c in stored) + sum(
            problem.segment_cost(s.start, s.stop - 1, {s.start - 1: chosen[s.start - 1]}) for s in segs)
        memory = sum(c.memory_bytes for c in chosen) + sum(
            problem.segment_memory(s.start, s.stop - 1, {s.start - 1: chosen[s.start - 1]}) for s in segs)
        assert problem.layer_time(list(picks), chain_aware=True) == pytest.approx(time)
        assert problem.layer_memory(list(picks), stash=True) == pytest.approx(memory)


def _reads_past() -> Problem:
    """Ops 0..4; op 1 (kept or compressed) has two outputs, one read by op 2 and one by op 4 past ops 2 and 3 (the
    attention's q and k, and v): what a segment holds of them, and pays to read them, follows which it reads."""
    keep = [Choice(Decision.keep(), 10.0, 0.0)]
    rec = Choice(Decision.recompute(), 0.0, 1.0, remat_bytes=10.0)
    choices = [keep, [Choice(Decision.keep(), 0.0, 0.0, (), (6.0, 4.0)),
                      Choice(Decision.compress("int4_symmetric"), 0.0, 0.0, (0.3, 0.2), (1.5, 1.0))],
               [*keep, rec], [*keep, rec], [*keep, rec]]
    outputs = [((frozenset({1}), 10.0),), ((frozenset({2}), 60.0), (frozenset({4}), 40.0)),
               ((frozenset({3}), 10.0),), ((frozenset({4}), 10.0),), ((frozenset(), 10.0),)]
    return Problem(choices=choices, num_layers=1, static_bytes=0.0, budget_bytes=None,
                   segment_time=lambda a, b: float(b - a + 1), reads=((1, 4),), outputs=outputs)


def test_a_segment_holds_and_pays_for_the_outputs_it_reads_past_the_ops_between() -> None:
    problem = _reads_past()
    kept, packed = problem.choices[1]
    only_v = {0: problem.choices[0][0], 1: kept, 2: problem.choices[2][0]}  # ops 3 and 4 recomputed
    assert problem.segment_memory(3, 4, only_v) == 4.0  # op 4 reads v; op 3 reads op 2's output, saved
    assert problem.segment_memory(2, 4, {0: problem.choices[0][0], 1: kept}) == 10.0  # q, k and v
    with_packed = {**only_v, 1: packed}
    assert problem.segment_memory(3, 4, with_packed) == 1.0
    assert problem.segment_cost(3, 4, with_packed) == 2.0 + 0.2  # the re-run, and reading v back
    assert problem.segment_cost(2, 4, {0: problem.choices[0][0], 1: packed}) == 3.0 + 0.5
    # at the re-run, a compressed input is decompressed beside its stored form: v's 40 bytes, not all 100
    assert problem.rerun_copies(3, 4, with_packed) == 40.0
    # picks: op 1 compressed, op 2 kept, ops 3 and 4 recomputed; the layer's bytes and time count v's stash
    assert problem.layer_memory([0, 1, 0, 1, 1], stash=True) == 10.0 + 10.0 + 1.0
    assert problem.layer_time([0, 1, 0, 1, 1], chain_aware=True) == 2.2


def test_an_op_that_saves_nothing_pays_its_codec_only_through_a_stash() -> None:
    """``linear_fc1`` saves nothing for backward (the activation saves its input): compressing it costs no time in
    forward unless a segment re-runs from its output, which then compresses and decompresses it (issue 18: the
    profile zeroed those times, and the MILP saw a free stash)."""
    from megatron_adacc.adacc.policy.cost_model import build_problem
    from megatron_adacc.adacc.policy.ops import OP_NAMES
    from megatron_adacc.adacc.policy.profile import CodecProfile, StashedOutput, analytic_profile
    from megatron_adacc.adacc.policy.signature import plain_signature

    profile = analytic_profile(plain_signature(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                                               seq_length=32, micro_batch_size=2, dtype="float32", num_layers=2,
                                               megatron_core_version="0.16.1"))
    fc1 = OP_NAMES.index("linear_fc1")
    op = profile.ops[fc1]
    op.saved_bytes = 0
    op.codecs = {"int4_outlier": CodecProfile(0, 0.004, 0.006, {})}
    for other in profile.ops:
        other.stash = [StashedOutput(("activation",) if other is op else (), {"keep": 0}, 64)]
    op.stash = [StashedOutput(("activation",), {"keep": 64 * 256 * 4, "int4_outlier": 9000}, 64 * 256 * 4)]
    problem = build_problem(profile, None)
    packed = next(c for c in problem.choices[fc1] if c.decision.action == "compress")
    assert packed.time_s == 0.0 and packed.memory_bytes == 0.0
    assert packed.rerun_s == pytest.approx((0.01 * profile.codec_time_scale,))
    assert packed.stash == (9000.0,)
