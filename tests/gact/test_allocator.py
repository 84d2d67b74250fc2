"""GACT's bit allocator: what the hooks get before, after and without an adaptation; its checkpoint state."""

from __future__ import annotations

import json
import math

import pytest

from megatron_adacc.gact.allocation import allocate_bits, predicted_variance
from megatron_adacc.gact.allocator import BitAllocator


def test_fixed_bits_are_the_largest_level_within_the_budget():
    assert BitAllocator(4.5).fixed_bits == 4
    assert BitAllocator(32).fixed_bits == 32
    fixed = BitAllocator(3, adaptive=False)
    fixed.dims = {0: 10}
    fixed.allocate({0: 1.0})
    assert fixed.bits_for(0, 10) == 2  # a non-adaptive allocator ignores allocations


def test_bits_follow_the_allocation_while_the_tensor_keeps_its_size():
    alloc = BitAllocator(4)
    assert alloc.bits_for(0, 100) == 4 and alloc.dims == {0: 100}  # unseen: the budget's level
    alloc.dims.update({1: 100, 2: 100})
    bits = alloc.allocate({0: 1e4, 1: 1.0, 2: 0.0})
    assert bits == dict(zip([0, 1, 2], allocate_bits([1e4, 1.0, 0.0], [100] * 3, 4)))
    assert bits[0] > bits[1] >= bits[2]  # the most sensitive tensor gets the most bits
    assert sum(bits[t] * 100 for t in bits) <= 4 * 300
    assert alloc.predicted_variance == pytest.approx(predicted_variance([1e4, 1.0, 0.0], list(bits.values())))
    assert [alloc.bits_for(t, 100) for t in range(3)] == [bits[0], bits[1], bits[2]]
    assert alloc.bits_for(0, 50) == 4  # same id, different size: the graph changed, the allocation is stale
    assert alloc.bits_for(3, 100) == 4  # a tensor no adaptation has seen


def test_unmeasurable_sensitivities_count_as_the_most_sensitive():
    alloc = BitAllocator(4)
    alloc.dims = {0: 100, 1: 100, 2: 100}
    bits = alloc.allocate({0: math.inf, 1: 2.0, 2: math.nan})
    assert alloc.sensitivity == {0: 2000.0, 1: 2.0, 2: 2000.0}
    assert bits[0] >= bits[1] and bits[2] >= bits[1]
    alloc.allocate({0: math.inf, 1: 0.0, 2: 0.0})  # nothing finite above zero: the cap is 1
    assert alloc.sensitivity[0] == 1.0


def test_histogram_mean_bits_and_checkpoint_round_trip():
    alloc = BitAllocator(4)
    assert alloc.mean_bits() is None and alloc.histogram() == {}
    alloc.dims = {0: 300, 1: 100}
    bits = alloc.allocate({0: 1.0, 1: 50.0})
    assert alloc.histogram() == {b: list(bits.values()).count(b) for b in sorted(set(bits.values()))}
    assert alloc.mean_bits() == pytest.approx((bits[0] * 300 + bits[1] * 100) / 400)
    state = json.loads(json.dumps(alloc.state_dict()))  # checkpoints stringify the ids
    restored = BitAllocator(4)
    restored.load_state_dict(state)
    assert (restored.bits, restored.sensitivity, restored.dims) == (alloc.bits, alloc.sensitivity, alloc.dims)
    assert restored.bits_for(1, 100) == bits[1]


def test_a_budget_outside_the_levels_is_refused():
    with pytest.raises(ValueError, match="outside the bit levels"):
        BitAllocator(0.5)
    with pytest.raises(ValueError, match="outside the bit levels"):
        BitAllocator(33)
