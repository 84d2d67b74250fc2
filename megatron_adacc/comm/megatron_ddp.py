"""Compressed, error-feedback gradient reduction inside megatron-core's ``DistributedDataParallel``.

Megatron has no communication-hook API. The one place that sees each bucket's complete local gradient right
before communication is ``_ParamAndGradBucketGroup.start_grad_sync``: the backward hook reaches it when
``overlap_grad_reduce`` is on, ``finish_grad_sync`` when it is off. :func:`attach` gives every bucket group
an instance-level replacement (the class is untouched, the original stays reachable as ``__wrapped__``)
that keeps the original's contract:

* return early when ``is_first_batch`` and a reduction is already in flight;
* (0.17+ / 0.19 line) drain the predecessor bucket group, wait for CUDA-graph weight-gradient events and copy
  ``params_with_extra_main_grads`` into the buffer first, as the 0.19 original does; ``finish_grad_sync``
  copies them back itself;
* run ``check_grads`` when the DDP config asks for it;
* scale ``grad_data`` by ``gradient_scaling_factor`` and average in the collective when
  ``average_in_collective``;
* with ``overlap_grad_reduce`` set ``grad_reduce_handle`` to an object whose ``wait()`` completes the
  reduction (here: decompresses every rank's payload into the bucket); without it, finish synchronously.

Each parameter's gradient is the slice ``bucket.grad_data[param_to_index[p]]`` of its flat bucket; it is
compressed per parameter (layer-wise, as in the paper; bounded by the shards under the reduce-scatter
transport) and the residual schemes see parameter names and shapes. A bucket group is one batch of the
transport (:mod:`megatron_adacc.comm.transport`): one all-gather of its payloads, or the compressed
reduce-scatter over Megatron's own bucket shards.

The distributed optimizer is supported: it reads only the rank's shard of each bucket (``local_data_view``,
Megatron's ``shard_buffer``), which the all-gather fills along with the rest of the bucket and the reduce-scatter
fills alone (no second compression then). Several distributed-optimizer instances
(``num_distributed_optimizer_instances > 1``) are not.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_adacc.comm.base import GradBucket, ParamSlot
from megatron_adacc.comm.pipeline import CompressedReducer
from megatron_adacc.comm.wire import all_reduce_moved, nbytes, reduce_scatter_moved
from megatron_adacc.compat.versions import megatron_line
from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.patching import mark, patch, unpatch

_MARK = "__megatron_adacc_resireduce__"


class UnsupportedDDPConfig(AdaccError, ValueError):
    """A Megatron DDP configuration the compressed reduction cannot serve."""


@dataclass
class _BucketGroupState:
    reducer: CompressedReducer
    names: list[str]
    batch: int


@dataclass
class MegatronAttachment:
    """What :func:`attach` installed; :meth:`detach` restores Megatron's own reduction."""

    reducer: CompressedReducer
    bucket_groups: list[Any] = field(default_factory=list)
    slots: list[ParamSlot] = field(default_factory=list)
    uncompressed_bytes_per_step: int = 0

    def detach(self) -> None:
        for bg in self.bucket_groups:
            if _MARK in bg.__dict__:
                unpatch(bg, "start_grad_sync")
                del bg.__dict__[_MARK]
        self.bucket_groups = []


def _check_ddp(ddp: Any) -> None:
    if not hasattr(ddp, "bucket_groups") or not hasattr(ddp, "ddp_config"):
        raise UnsupportedDDPConfig(
            f"ResiReduce attaches to megatron.core.distributed.DistributedDataParallel; "
            f"got {type(ddp).__name__}. "
            f"Wrap the model with Megatron's DDP (Megatron FSDP and torch DDP are different paths: use "
            f"megatron_adacc.comm.ddp_hook for torch.nn.parallel.DistributedDataParallel)."
        )
    cfg = ddp.ddp_config
    if getattr(cfg, "num_distributed_optimizer_instances", 1) > 1:
        raise UnsupportedDDPConfig(
            "ResiReduce does not support num_distributed_optimizer_instances > 1 (its second, inter-instance "
            "all-reduce would run on uncompressed shards); use one distributed-optimizer instance."
        )
    if getattr(cfg, "use_megatron_fsdp", False) or getattr(cfg, "use_custom_fsdp", False):
        raise UnsupportedDDPConfig("ResiReduce does not support Megatron FSDP; use Megatron DDP.")


def _all_bucket_groups(ddp: Any) -> list[Any]:
    return list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []) or [])


def _buckets(bg: Any, names: dict[Any, str]) -> list[GradBucket]:
    out = []
    for bucket in bg.buckets:
        params = tuple((names[p], bucket.param_to_index[p][0], tuple(p.shape)) for p in bucket.params_list)
        out.append(GradBucket(bucket.grad_data, params))
    return out


def _prologue_019(self: Any, force_all_reduce: bool) -> None:
    """Steps 0.17+ added at the top of ``start_grad_sync`` (0.19.0 ``param_and_grad_buffer.py:608-647``)."""
    previous = getattr(self, "previous_grad_reduce_bucket_group", None)
    if previous is not None and previous.grad_reduce_handle is not None:
        previous.finish_grad_sync(force_all_reduce=force_all_reduce)
    events = {}
    for bucket in self.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None:
                events[id(event)] = event
    if events:
        stream = torch.cuda.current_stream()
        for event in events.values():
            stream.wait_event(event)
    for bucket in self.buckets:
        for param in getattr(bucket, "params_with_extra_main_grads", ()):
            if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)


def _make_start_grad_sync(line: tuple[int, int], names: dict[Any, str], state: _BucketGroupState):
    def start_grad_sync(self: Any, force_all_reduce: bool | None = False) -> None:
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        if line >= (0, 17):
            _prologue_019(self, bool(force_all_reduce))
        assert self.grad_reduce_handle is None, (
            "Should not have multiple communication calls outstanding at once"
        )
        cfg = self.ddp_config
        if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
            self.check_grads(
                check_for_nan_or_inf=cfg.check_for_nan_in_grad, check_for_large=cfg.check_for_large_grads
            )
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        group = (
            self.intra_distributed_optimizer_instance_group
            if cfg.use_distributed_optimizer
            else self.data_parallel_group
        )
        async_op = bool(cfg.overlap_grad_reduce)
        pending = state.reducer.reduce(
            _buckets(self, names), group=group, average=bool(cfg.average_in_collective), async_op=async_op,
            shard_only=bool(cfg.use_distributed_optimizer and not force_all_reduce), key=str(state.batch),
        )
        self.grad_reduce_handle = pending if async_op else None

    return start_grad_sync


def attach(ddp_models: Any | Sequence[Any], reducer: CompressedReducer) -> MegatronAttachment:
    """Route the gradient reduction of Megatron DDP model chunk(s) through ``reducer``.

    Registers every parameter with ``reducer.memory`` (batch = bucket group, so reusable groups never span
    two bucket groups) and replaces each bucket group's ``start_grad_sync``. Idempotence: attaching twice
    is an error (detach first).
    """
    line = megatron_line()
    chunks = list(ddp_models) if isinstance(ddp_models, (list, tuple)) else [ddp_models]
    attachment = MegatronAttachment(reducer)
    names: dict[Any, str] = {}
    groups: list[tuple[Any, list[str]]] = []
    for c, ddp in enumerate(chunks):
        _check_ddp(ddp)
        prefix = f"chunk{c}." if len(chunks) > 1 else ""
        module = getattr(ddp, "module", ddp)
        for name, param in module.named_parameters():
            names[param] = prefix + name
        for bg in _all_bucket_groups(ddp):
            if _MARK in bg.__dict__:
                raise RuntimeError("ResiReduce is already attached to this model; call detach() first")
            missing = [p for b in bg.buckets for p in b.params_list if p not in names]
            if missing:
                raise RuntimeError(f"{len(missing)} parameters in a DDP bucket have no name in the module")
            groups.append((bg, [names[p] for b in bg.buckets for p in b.params_list]))
    for batch, (bg, _) in enumerate(groups):
        for bucket in bg.buckets:
            for param in bucket.params_list:
                attachment.slots.append(
                    ParamSlot(
                        names[param],
                        tuple(param.shape),
                        bucket.grad_data.dtype,
                        batch,
                        bucket.grad_data.device,
                    )
                )
            # What Megatron's own collective would send per rank: a reduce-scatter, or an all-reduce.
            size = nbytes(bucket.grad_data)
            if bg.ddp_config.use_distributed_optimizer:
                moved = reduce_scatter_moved(size, bg.intra_distributed_optimizer_instance_size)
            else:
                moved = all_reduce_moved(size, torch.distributed.get_world_size(bg.data_parallel_group))
            attachment.uncompressed_bytes_per_step += moved.sent
    reducer.memory.register(attachment.slots)
    for batch, (bg, bg_names) in enumerate(groups):
        state = _BucketGroupState(reducer, bg_names, batch)
        _replace_start_grad_sync(bg, _make_start_grad_sync(line, names, state))
        bg.__dict__[_MARK] = state
        attachment.bucket_groups.append(bg)
    return attachment


def _replace_start_grad_sync(bg: Any, start_grad_sync: Any) -> None:
    """``bg.start_grad_sync`` becomes ``start_grad_sync`` bound to ``bg``: an instance attribute, so the class and
    the model's other bucket groups stay untouched, and :func:`~megatron_adacc.core.patching.unpatch` restores it.
    The method is marked here because a bound method cannot take the attributes ``patch`` would copy onto it."""
    patch(bg, "start_grad_sync", lambda original: mark(types.MethodType(start_grad_sync, bg), original),
          "the one place Megatron DDP hands a bucket group's gradients to the collective")
