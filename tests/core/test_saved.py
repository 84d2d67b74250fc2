"""The saved-tensor base every pack hook specialises: parameters by reference, one stored copy per tensor,
dropout masks in 1 bit and back exactly, NaN/Inf flags noted without a host read, and storage accounting."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from megatron_adacc.codecs import get_codec
from megatron_adacc.core import saved
from megatron_adacc.core.saved import (
    NonFiniteActivations,
    SavedHandle,
    SavedTensorStore,
    storage_ptr,
    tensor_key,
    unique_storage_bytes,
)


class Handle(SavedHandle):
    __slots__ = ("codec", "packed")

    def __init__(self, codec, packed):
        self.codec, self.packed = codec, packed

    def unpack(self) -> torch.Tensor:
        return self.codec.decompress(self.packed)


class Store(SavedTensorStore):
    """The base as the features use it: the codecs' 1-bit mask codec, an INT4 codec for floats (or none),
    and the kept storages counted in the ledger."""

    def __init__(self, model_tensors=(), quantize: bool = True):
        super().__init__(model_tensors)
        self.quantize = quantize
        self.compress_calls = 0

    def pack_mask(self, t, *context):
        return Handle(get_codec("bitmask"), get_codec("bitmask").compress(t))

    def compress(self, t, *context):
        self.compress_calls += 1
        if not self.quantize:
            return None
        codec = get_codec("int4_symmetric", group="row")
        packed = codec.compress(t)
        self.note_nonfinite(packed.nonfinite, t, *context)
        return Handle(codec, packed)

    def store_tensor(self, t, *context):
        stored = super().store_tensor(t, *context)
        if stored is t:
            self.count_storage(t)
        return stored


# ------------------------------------------------------------------------------------ unique_storage_bytes
def test_unique_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10)              # 40 bytes
    b = torch.zeros(4, dtype=torch.float64)  # 32 bytes
    assert unique_storage_bytes([a, a[2:5], a.view(2, 5), b]) == 72
    assert unique_storage_bytes([a[:1]]) == 40  # a view holds its whole storage
    assert unique_storage_bytes([None, 3, "x", a]) == 40  # non-tensors (optimizer "step" ints) are skipped
    assert unique_storage_bytes([torch.zeros(0), torch.zeros(0, 3)]) == 0
    assert unique_storage_bytes(t for t in (a, b)) == 72  # any iterable


def test_a_shared_seen_set_counts_storages_once_across_calls():
    a, b = torch.zeros(8), torch.zeros(16)
    seen: set[int] = set()
    assert unique_storage_bytes([a], seen) == 32
    assert unique_storage_bytes([a.view(2, 4), b], seen) == 64  # a already counted
    assert unique_storage_bytes([b, a], seen) == 0
    assert seen == {storage_ptr(a), storage_ptr(b)}


def test_tensor_key_names_one_view():
    a = torch.zeros(4, 6)
    assert tensor_key(a) == tensor_key(a.view(4, 6))
    assert tensor_key(a) != tensor_key(a.t())
    assert tensor_key(a) != tensor_key(a[1:])
    assert tensor_key(a) != tensor_key(a.view(torch.int32))


# ------------------------------------------------------------------------------------ classification
def test_parameters_and_views_of_model_storage_are_kept_by_reference():
    lin = nn.Linear(8, 8)
    buf = torch.zeros(8)
    store = Store([*lin.parameters(), buf])
    assert store.pack(lin.weight) is lin.weight
    view = lin.weight.detach().t()  # not a Parameter, but the weight's storage
    assert store.pack(view) is view
    part = buf[2:]  # a view of a buffer
    assert store.pack(part) is part
    stray = nn.Parameter(torch.randn(8, 8))  # a parameter the store was not told about
    assert store.pack(stray) is stray
    assert store.compress_calls == 0 and store.storage_bytes == 0


def test_masks_pack_to_one_bit_and_back_exactly():
    store = Store()
    mask = torch.rand(1000, generator=torch.Generator().manual_seed(0)) > 0.3
    packed = store.pack(mask)
    assert isinstance(packed, SavedHandle)
    assert packed.packed.nbytes == 125  # 1000 bits
    out = store.unpack(packed)
    assert out.dtype == torch.bool and torch.equal(out, mask)
    odd = torch.tensor([[True, False, True], [False, False, True]]).t()  # non-contiguous, 6 bits
    assert torch.equal(store.unpack(store.pack(odd)), odd)


def test_floats_go_to_compress_and_other_dtypes_are_kept():
    store = Store()
    x = torch.randn(4, 64)
    packed = store.pack(x)
    assert isinstance(packed, Handle) and packed.packed.nbytes < x.nbytes
    assert (store.unpack(packed) - x).abs().max() < x.abs().max() / 4  # INT4: close, not exact
    idx = torch.arange(10)
    assert store.pack(idx) is idx
    assert store.compress_calls == 1
    assert store.storage_bytes == idx.nbytes  # the kept index tensor; the compressed one is not in the ledger


def test_compress_returning_none_keeps_the_tensor():
    store = Store(quantize=False)
    x = torch.randn(16)
    assert store.pack(x) is x
    assert store.unpack(x) is x


def test_non_finite_input_is_compressed_flagged_and_decodes_with_a_nan(monkeypatch):
    watch = NonFiniteActivations(interval_s=0)
    monkeypatch.setattr(saved, "NONFINITE", watch)
    store = Store()
    bad = torch.randn(2, 32)
    bad[1, 3] = float("nan")
    inf = torch.full((1, 8), float("inf"))
    handles = [store.pack(bad), store.pack(inf), store.pack(torch.randn(2, 32))]
    assert all(isinstance(h, Handle) for h in handles)  # nothing read, nothing kept
    assert store.storage_bytes == 0
    assert int(watch.clean()) == 0  # the step's verdict, on the device
    vector, taken = watch.take()
    assert vector.tolist() == [1, 1, 0]
    watch.settle(taken, vector.tolist())
    assert (watch.last_step, watch.total) == (2, 2)
    assert all(torch.isnan(store.unpack(h).view(-1)[0]) for h in handles[:2])
    assert torch.isfinite(store.unpack(handles[2])).all()


# ------------------------------------------------------------------------------------ de-duplication
def test_a_tensor_saved_twice_is_stored_once():
    store = Store()
    x = torch.randn(8, 32)
    first = store.pack(x)
    assert store.pack(x) is first
    assert store.pack(x.view(8, 32)) is first  # another view with the same geometry
    assert store.compress_calls == 1 and store.dedup_hits == 2
    assert store.pack(x.t()) is not first  # a different view is a different value
    assert store.compress_calls == 2


def test_a_kept_tensor_saved_twice_is_counted_once():
    store = Store(quantize=False)
    x = torch.randn(64)
    store.pack(x)
    store.pack(x)
    store.pack(x[1:])  # another view: stored again, but its storage is already counted
    assert store.storage_bytes == unique_storage_bytes([x]) == 256


def test_a_tensor_modified_in_place_is_stored_again():
    store = Store()
    x = torch.randn(8, 32)
    first = store.pack(x)
    x.mul_(2)
    second = store.pack(x)
    assert second is not first
    assert torch.allclose(store.unpack(second), 2 * store.unpack(first))


def test_a_dead_tensor_does_not_answer_for_a_new_one():
    class OneKey(Store):
        def dedup_key(self, t):
            return (0, "everything")  # as if the allocator gave every tensor the same address

    store = OneKey()
    a = torch.randn(4, 32)
    first = store.pack(a)
    assert store.pack(torch.randn(4, 32)) is first  # `a` alive: the key still means `a`
    del a
    gc.collect()
    assert store.pack(torch.randn(4, 32)) is not first

    class Strong(OneKey):
        weak_dedup = False  # the subclass retires keys itself

    store = Strong()
    first = store.pack(torch.randn(4, 32))
    assert store.pack(torch.randn(4, 32)) is first
    store.forget(0)
    assert store.pack(torch.randn(4, 32)) is not first


def test_forget_retires_only_that_storage():
    store = Store()
    a, b = torch.randn(4, 32), torch.randn(4, 32)
    pa, pb = store.pack(a), store.pack(b)
    store.forget(storage_ptr(a))
    assert store.pack(a) is not pa
    assert store.pack(b) is pb


def test_clear_drops_copies_ledger_and_counters():
    store = Store()
    x = torch.randn(4, 32)
    first = store.pack(x)
    store.pack(x)
    store.pack(torch.arange(3))
    store.pack(torch.tensor([[float("inf")]]))
    assert store.dedup_hits == 1 and store.storage_bytes > 0
    store.clear()
    assert (store.dedup_hits, store.storage_bytes) == (0, 0)
    assert store.pack(x) is not first


# ------------------------------------------------------------------------------------ accounting
def test_count_storage_counts_live_storages_once_and_freed_ones_afresh():
    store = SavedTensorStore()
    a = torch.zeros(16)
    assert store.count_storage(a, owner="op1") == 64
    assert store.count_storage(a[3:], owner="op2") == 0
    assert store.storages[storage_ptr(a)].owner == "op1"  # the first owner keeps it
    ptr = storage_ptr(a)
    del a
    gc.collect()
    fake = torch.zeros(4)
    store.storages[storage_ptr(fake)] = store.storages.pop(ptr)  # pretend `fake` reuses the freed address
    assert store.count_storage(fake) == 16 and store.storage_bytes == 16


class _SavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * (a + b)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _forward(model: nn.Module, x: torch.Tensor, p: float = 0.25) -> torch.Tensor:
    h = model[1](model[0](x))
    h, _ = torch.native_dropout(h, p, True)  # saves a bool mask, as CUDA dropout does
    h = _SavedTwice.apply(model[2](h))
    return model[4](model[3](h)).square().mean()


def test_hooks_with_nothing_compressed_give_bit_identical_gradients():
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref = _model()
    torch.manual_seed(7)
    _forward(ref, x).backward()
    model = _model()
    store = Store(model.parameters(), quantize=False)
    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
        loss = _forward(model, x)
    assert store.dedup_hits >= 1  # _SavedTwice saved one tensor twice
    loss.backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_ledger_equals_unique_storage_bytes_of_what_autograd_keeps():
    model = _model()
    store = Store(model.parameters(), quantize=False)
    kept: list[torch.Tensor] = []

    def pack(t):
        out = store.pack(t)
        if out is t and not store.is_model_tensor(t):
            kept.append(t)
        return out

    x = torch.randn(8, 16)
    with torch.autograd.graph.saved_tensors_hooks(pack, store.unpack):
        loss = _forward(model, x)
    assert kept and store.storage_bytes == unique_storage_bytes(kept)
    assert all(t.dtype != torch.bool for t in kept)  # the dropout mask went to 1 bit, not to the ledger
    loss.backward()


# ------------------------------------------------------------------------------------ the step's end
def test_step_end_takes_every_source_as_one_vector_and_hands_the_numbers_back():
    from megatron_adacc.core.step_end import StepEnd

    class Source:
        def __init__(self, values):
            self.values, self.got = values, None

        def take(self):
            return None if self.values is None else (torch.tensor(self.values), len(self.values))

        def settle(self, taken, values):
            self.got = (taken, values)

    end = StepEnd()
    a, empty, b = end.register(Source([3, 0])), end.register(Source(None)), end.register(Source([7]))
    assert end.register(a) is a and len(end._sources) == 3
    vector = end.take()
    assert vector.tolist() == [3, 0, 7] and end.take() is vector  # taken once per step
    end.settle([3.0, 0.0, 7.0])  # as the host read them, alongside its own values
    assert (a.got, empty.got, b.got) == ((2, [3, 0]), None, (1, [7]))
    end.settle()  # nothing taken since: reads it itself
    assert a.got == (2, [3, 0])
    end.take()
    with pytest.raises(ValueError, match="1 values for a vector of 3"):
        end.settle([1])
