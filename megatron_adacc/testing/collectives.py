"""Count the bytes ``torch.distributed``'s collectives move, whoever calls them: ResiReduce's transports and
Megatron's own gradient reduction alike.

:func:`counting` wraps the collectives for the length of a ``with`` block and adds what each call moves, by the
rules of :mod:`megatron_adacc.comm.wire` applied to the tensors the caller hands it, to a
:class:`~megatron_adacc.comm.wire.Traffic`. Megatron binds its reduce-scatter and all-gather to module globals
when it is imported (``param_and_grad_buffer.dist_reduce_scatter_func``), so those are wrapped too. Counting
here does not go through any transport's own bookkeeping, so it checks that bookkeeping and the byte model.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from megatron_adacc.comm import wire
from megatron_adacc.core.patching import patch, unpatch

_MEGATRON_BUFFER = "megatron.core.distributed.param_and_grad_buffer"


def _group(args: tuple, kwargs: dict, position: int) -> Any:
    return kwargs.get("group", args[position] if len(args) > position else None)


def _all_gather(traffic: wire.Traffic) -> Callable:
    def make(original):
        def all_gather(output, input, *args, **kwargs):
            traffic.add(wire.all_gather_moved(wire.nbytes(input), dist.get_world_size(_group(args, kwargs, 0))))
            return original(output, input, *args, **kwargs)
        return all_gather
    return make


def _reduce_scatter(traffic: wire.Traffic) -> Callable:
    def make(original):
        def reduce_scatter(output, input, *args, **kwargs):
            world = dist.get_world_size(_group(args, kwargs, 1))
            traffic.add(wire.reduce_scatter_moved(wire.nbytes(input), world))
            return original(output, input, *args, **kwargs)
        return reduce_scatter
    return make


def _all_reduce(traffic: wire.Traffic) -> Callable:
    def make(original):
        def all_reduce(tensor, *args, **kwargs):
            traffic.add(wire.all_reduce_moved(wire.nbytes(tensor), dist.get_world_size(_group(args, kwargs, 1))))
            return original(tensor, *args, **kwargs)
        return all_reduce
    return make


def _all_to_all(traffic: wire.Traffic) -> Callable:
    def make(original):
        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
            group = _group(args, kwargs, 0)
            world, size = dist.get_world_size(group), input.element_size()
            sends = input_split_sizes or [input.numel() // world] * world
            receives = output_split_sizes or [output.numel() // world] * world
            traffic.add(wire.all_to_all_moved([s * size for s in sends], [s * size for s in receives],
                                              dist.get_rank(group)))
            return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
        return all_to_all_single
    return make


@contextlib.contextmanager
def counting(traffic: wire.Traffic) -> Iterator[wire.Traffic]:
    """Add to ``traffic`` what every collective called inside the block moves (this rank's share)."""
    targets = [(dist, "all_gather_into_tensor", _all_gather), (dist, "reduce_scatter_tensor", _reduce_scatter),
               (dist, "all_reduce", _all_reduce), (dist, "all_to_all_single", _all_to_all)]
    megatron = sys.modules.get(_MEGATRON_BUFFER)
    if megatron is not None:
        targets += [(megatron, "dist_reduce_scatter_func", _reduce_scatter),
                    (megatron, "dist_all_gather_func", _all_gather)]
    for owner, name, wrapper in targets:
        patch(owner, name, wrapper(traffic), "counting the bytes a collective moves")
    try:
        yield traffic
    finally:
        for owner, name, _ in targets:
            unpatch(owner, name)
