"""Predicted times on a GPU no one has here: a roofline of every kernel a model runs on fake tensors.

:class:`Roofline` watches each ATen op the code dispatches (forward and backward, the runtime's ops or megatron's
own) and charges it ``max(FLOPs / peak FLOP/s, bytes moved / bandwidth)``: FLOPs from PyTorch's own counter
(``torch.utils.flop_counter``), bytes as what the op reads and writes. Views, allocations and copies of nothing
cost nothing. What a roofline leaves out, it leaves out for every method alike: kernel launches, caches, how close
real kernels come to the peaks, and communication (tensor- and data-parallel collectives, pipeline transfers).
So its absolute times are optimistic, and what it is for is ratios between methods on the same model: every figure
it gives is printed as a prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from megatron_adacc.core.gpus import GpuSpec
from megatron_adacc.core.saved import storage_ptr

_aten = torch.ops.aten

#: Ops that move no data: they only allocate.
_FREE = frozenset({_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided,
                   _aten.lift_fresh})


def _cpu_sdpa_flops(query, key, value, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


#: FLOP formulas beside PyTorch's: the CPU's flash attention, which a model sized on fake CPU tensors runs where a
#: GPU would run its own SDPA kernel (PyTorch counts the GPU kernels alone).
_MORE_FLOPS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    packet = func._overloadpacket
    formula = flop_registry.get(packet) or _MORE_FLOPS.get(packet)
    if formula is None:
        return 0
    shapes = [a.shape if isinstance(a, torch.Tensor) else a for a in args]
    if packet in _MORE_FLOPS:
        return int(formula(*args, out_val=out, **kwargs))
    return int(formula(*shapes, **kwargs, out_val=out))


#: ``beta * input + product``: with ``beta=0`` the kernel does not read ``input`` (megatron's attention scores).
_BETA = frozenset({_aten.addmm, _aten.baddbmm})


def _moves_nothing(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """No kernel: a query (``prim.device``), an allocation, or an op whose outputs are its inputs' storage (a view,
    ``_unsafe_view``) and that writes nothing."""
    if func.namespace != "aten" or func.is_view or func._overloadpacket in _FREE:
        return True
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not outs:
        return True
    if func._schema.is_mutable:
        return False
    ins = {storage_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(storage_ptr(t) in ins for t in outs)


def _moved_bytes(values: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


class Roofline(TorchDispatchMode):
    """Sums the roofline time of every op dispatched inside it (enter it inside the ``FakeTensorMode`` it times)."""

    def __init__(self, gpu: GpuSpec, dtype: str) -> None:
        super().__init__()
        self.flops_per_s, self.bytes_per_s = gpu.flops(dtype), gpu.bandwidth
        self.seconds = 0.0
        self.flops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _moves_nothing(func, args, kwargs, out):
            return out
        read = args[1:] if func._overloadpacket in _BETA and kwargs.get("beta", 1) == 0 else args
        flops, moved = _flops(func, args, kwargs, out), _moved_bytes((read, kwargs, out))
        self.flops += flops
        self.bytes += moved
        self.seconds += max(flops / self.flops_per_s, moved / self.bytes_per_s)
        return out


def memory_bound_seconds(nbytes: float, gpu: GpuSpec) -> float:
    """A kernel that only streams ``nbytes`` through memory (a codec, the optimizer's update)."""
    return nbytes / gpu.bandwidth
