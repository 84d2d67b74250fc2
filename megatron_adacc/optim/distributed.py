"""AdamA with Megatron's distributed optimizer: ``m``, ``v`` and the fp32 master weights sharded across the
data-parallel ranks, each micro-batch's gradient reduce-scattered to the rank that owns it and folded there.

What it computes
----------------
``M`` data-parallel ranks each run ``N`` micro-batches of ``b`` samples per step. As backward completes a bucket
of gradients (:mod:`~megatron_adacc.optim.layout`: Megatron's buckets and shards), the bucket is
reduce-scattered (Megatron's reduce-scatter, run once per micro-batch instead of once per step): the rank that
owns a slice receives ``G_i``, the mean over ranks of their micro-batch ``i`` gradients, that is the gradient of
*global micro-batch* ``i`` (the ``M`` ranks' ``i``-th micro-batches together, ``M x b`` samples). The owner folds
``g_i = G_i / N`` into its shard with Algorithm 2's fold, and the gradient is freed::

    m <- beta1 m + (1 - beta1) sum_i g_i          v <- beta2 v + (1 - beta2) sum_i g_i^2

So the sharded optimizer equals single-process :class:`~megatron_adacc.optim.adama.AdamA` over ``N``
micro-batches of ``M x b`` samples each, the ``i``-th being the ranks' ``i``-th micro-batches; with ``N = 1`` it
is Adam on the mini-batch (Megatron's distributed optimizer). ``g_i^2`` is the square of the *reduced*
gradient. That is the right quantity: AdamA's one departure from Adam is that ``v`` sums the squares of the
gradients it accumulates over time instead of squaring their sum; the ``M`` ranks' parts of one global
micro-batch are computed at the same time and are combined before squaring, as Adam combines the samples of a
batch. The result does not depend on how a global micro-batch is split across ranks, it is Adam whenever there
is nothing to accumulate, and it needs one reduce-scatter per micro-batch; folding per-rank squares instead
(Appendix B's form, which ``--adama`` without the distributed optimizer computes: AdamA over ``N x M``
micro-batches of ``b``) would need ``g^2`` reduce-scattered beside ``g``, twice the traffic, and drift further
from Adam as ranks are added. The cost against the paper's design is traffic: ``N`` gradient reduce-scatters per
step where Appendix B all-reduces ``m`` and ``v`` once, because those moments now live on one rank each.

Clipping (``clip_grad``)
------------------------
The mini-batch gradient never exists, so Megatron's clipping of it by its global norm cannot be done. Instead
each global micro-batch's gradient is clipped by its own global norm before it is folded:
``∇F_i <- ∇F_i min(1, c / (||∇F_i|| + 1e-6))``, the norm over every parameter and every rank (tensor-parallel
copies counted once), measured on ``∇F_i = N G_i`` (the micro-batch's mean-loss gradient). Each folded term then
has norm at most ``c / N``, so the step's first-moment update ``m_t - beta1 m_{t-1}`` has norm at most
``(1 - beta1) c``: Megatron's bound on the same update. With ``N = 1`` it is Megatron's clipping. It is not
Megatron's clipping for ``N > 1``: Megatron scales the summed gradient by one factor; this scales each
micro-batch's part by its own, so one outlier micro-batch is tamed without shrinking the others. The reduced
slices of a micro-batch are held (``4 / M`` bytes per parameter) until its backward ends and its norm is known.

Memory per parameter and rank (bf16 model, ``M`` ranks): bf16 parameters 2 + fp32 master, ``m``, ``v``
``12 / M``; no gradient buffer (Megatron's distributed optimizer with gradient accumulation: ``6 + 12 / M``,
its fp32 gradient buffer included). Transient: the buckets being filled and reduced (at most two, fp32), and
with clipping the ``4 / M`` above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.log import get_logger
from megatron_adacc.optim.adama import adam_update, decay_moments, fold_gradient
from megatron_adacc.optim.layout import Bucket, plan_buckets

__all__ = ["DistributedAdamA", "ShardMismatch"]

#: Megatron's guard against dividing by a zero norm when clipping.
_CLIP_EPS = 1e-6


class ShardMismatch(AdaccError, ValueError):
    """Saved optimizer shards that do not fit this run's layout (another data-parallel size or bucket size)."""


class _Shard:
    """This rank's slice of one bucket: the parameters' storage it updates, and its optimizer states."""

    def __init__(self, bucket: Bucket, storage: torch.Tensor, rank: int, dp_size: int,
                 group_of: dict[int, int], counted: set[int]) -> None:
        self.bucket = bucket
        self.storage = storage  # the bucket's parameters, one flat tensor (padding included)
        lo, hi = bucket.shard(rank, dp_size)
        self.params = storage[lo:hi]
        self.master = self.params.detach().float() if storage.dtype != torch.float32 else None
        self.exp_avg = torch.zeros(hi - lo, dtype=torch.float32, device=storage.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        # (param group, start, end) of each parameter's elements in the slice, and those the global norm counts
        # (ids of parameters: tensors compare by value).
        self.pieces: list[tuple[int, int, int]] = []
        self.norm_pieces: list[tuple[int, int]] = []
        for p, (s, e) in zip(bucket.params, bucket.ranges):
            s, e = max(s, lo) - lo, min(e, hi) - lo
            if s < e:
                self.pieces.append((group_of[id(p)], s, e))
                if id(p) in counted:
                    self.norm_pieces.append((s, e))
        self.counts_whole_slice = len(self.norm_pieces) == len(self.pieces)

    @property
    def theta(self) -> torch.Tensor:
        """What the update changes: the fp32 master weights, or the parameters themselves when fp32."""
        return self.master if self.master is not None else self.params

    def squared_norm(self, g: torch.Tensor) -> torch.Tensor:
        if self.counts_whole_slice:  # padding is zero
            return g.float().square().sum()
        return sum((g[s:e].float().square().sum() for s, e in self.norm_pieces), g.new_zeros((), dtype=torch.float))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        state = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            state["master_param"] = self.master
        return state


class DistributedAdamA(torch.optim.Optimizer):
    """AdamA sharded across data-parallel ranks as Megatron's distributed optimizer shards Adam (see the module
    docstring for what it computes and why).

    Args:
        params: parameter groups (each group's ``lr`` and ``weight_decay`` apply, AdamW's decoupled decay).
        lr, betas, eps, weight_decay: Adam's; ``betas`` are the optimizer's, not a group's (a bucket's fold spans
            groups).
        num_microbatches: ``N``, the micro-batches each rank runs per step.
        scale_by_num_microbatches: divide each gradient by ``N``; ``False`` when each micro-batch loss already
            is (Megatron's schedules).
        data_parallel_group: the ranks that shard the states (``None``: this process alone).
        bucket_size: elements per bucket, as Megatron's ``--ddp-bucket-size`` (``None``: one bucket, which
            holds the whole model's gradient while it fills: give a size).
        clip_grad: if > 0, clip every global micro-batch gradient to this global norm before folding it.
        grad_reduce_dtype: dtype gradients are reduced in (fp32: Megatron's ``grad_reduce_in_fp32``).
        pad_for_high_nccl_busbw: Megatron's ``pad_buckets_for_high_nccl_busbw`` layout.
        model_chunks: the model chunks, whose parameter order (``chunk.parameters()``) Megatron's layout follows;
            ``None``: the parameter groups' order.
    """

    def __init__(self, params: Iterable[dict[str, Any]], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, num_microbatches: int = 1,
                 scale_by_num_microbatches: bool = True, data_parallel_group: dist.ProcessGroup | None = None,
                 bucket_size: int | None = None, clip_grad: float = 0.0,
                 grad_reduce_dtype: torch.dtype = torch.float32, pad_for_high_nccl_busbw: bool = False,
                 model_chunks: Iterable[torch.nn.Module] | None = None) -> None:
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"DistributedAdamA: num_microbatches must be a positive int, got {num_microbatches!r}")
        if not clip_grad >= 0.0:
            raise ValueError(f"DistributedAdamA: clip_grad must be >= 0, got {clip_grad}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "decoupled_weight_decay": True})
        self.num_microbatches = num_microbatches
        self.scale_by_num_microbatches = scale_by_num_microbatches
        self.clip_grad = float(clip_grad)
        self.group = data_parallel_group
        self.dp_size = 1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
        self.dp_rank = 0 if data_parallel_group is None else dist.get_rank(data_parallel_group)
        self.reduce_dtype = grad_reduce_dtype
        self.step_count = torch.zeros((), dtype=torch.float32)
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        chunks = [trainable] if model_chunks is None else [list(c.parameters()) for c in model_chunks]
        if {id(p) for c in chunks for p in c if p.requires_grad} != {id(p) for p in trainable}:
            raise ValueError("DistributedAdamA: model_chunks must hold exactly the trainable parameters of the groups")
        self.buckets = plan_buckets(chunks, self.dp_size, bucket_size, pad_for_high_nccl_busbw=pad_for_high_nccl_busbw)
        _warn_large_buckets(self.buckets)
        self.shards = self._build_shards()
        self._where = {p: (b, r) for b in self.buckets for p, r in zip(b.params, b.ranges)}
        self._round = _Round(len(self.buckets))
        self._rounds = 0  # micro-batches folded since the last step
        self._paused = 0
        self._host_checks = False
        self._largest_norm: torch.Tensor | None = None
        self.peak_transient_bytes = 0
        self._transient_bytes = 0
        self._warned_idle = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]

    # ------------------------------------------------------------------ set-up

    def _build_shards(self) -> list[_Shard]:
        """Give each bucket's parameters one flat storage (Megatron's parameter buffer, which the all-gather
        fills in place) and this rank's slice of it its states."""
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        counted = _counted_in_norm([p for g in self.param_groups for p in g["params"]])
        shards = []
        with torch.no_grad():
            for bucket in self.buckets:
                storage = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.params[0].device)
                for p, (s, e) in zip(bucket.params, bucket.ranges):
                    storage[s:e].copy_(p.detach().view(-1))
                    p.data = storage[s:e].view(p.shape)
                shards.append(_Shard(bucket, storage, self.dp_rank, self.dp_size, group_of, counted))
        return shards

    # ------------------------------------------------------- mini-batch protocol

    @property
    def pending_microbatches(self) -> int:
        """Micro-batches folded (or being folded) since the last :meth:`step`."""
        return self._rounds + (1 if self._round.started else 0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a mini-batch: checks no micro-batch is folded yet, drops gradients left by a paused backward."""
        if self.pending_microbatches:
            raise RuntimeError(
                f"DistributedAdamA: a new mini-batch was started while {self.pending_microbatches} micro-batch "
                "gradients are already folded into m and v; they cannot be discarded. Call step() first.")
        for shard in self.shards:
            for p in shard.bucket.params:
                p.grad = None

    @contextlib.contextmanager
    def accumulation_paused(self) -> Iterator[None]:
        """Backward passes inside leave gradients in ``.grad`` instead of reducing and folding them."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ----------------------------------------------------- one micro-batch's backward

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._paused or p.grad is None:
            return
        with torch.no_grad():
            if id(p) in self._round.fired:  # a new micro-batch began before every parameter had its gradient
                self._warn_idle()
                self._end_round()
            bucket, (s, e) = self._where[p]
            self._round.fired.add(id(p))
            buffer = self._round.filling.get(bucket.index)
            if buffer is None:
                buffer = self._round.filling[bucket.index] = self._new_buffer(bucket.numel)
            buffer[s:e].view(p.shape).copy_(p.grad)
            p.grad = None
            self._round.arrived[bucket.index] += 1
            if self._round.arrived[bucket.index] == len(bucket.params):
                self._round.complete.add(bucket.index)
                while self._round.next in self._round.complete:
                    self._dispatch(self._round.next)
                if self._round.next == len(self.buckets):
                    self._end_round()

    def _new_buffer(self, numel: int) -> torch.Tensor:
        buffer = torch.zeros(numel, dtype=self.reduce_dtype, device=self.shards[0].storage.device)
        self._count_transient(buffer.numel() * buffer.element_size())
        return buffer

    def _count_transient(self, nbytes: int) -> None:
        self._transient_bytes += nbytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._transient_bytes)

    def _dispatch(self, index: int) -> None:
        """Reduce-scatter bucket ``index`` (every rank, in bucket order); fold the one before it, whose reduction
        had this bucket's backward to complete in."""
        buffer = self._round.filling.pop(index, None)
        if buffer is None:  # no parameter of the bucket had a gradient in this micro-batch: zeros
            buffer = self._new_buffer(self.buckets[index].numel)
        out, work = buffer, None
        if self.dp_size > 1:
            buffer.mul_(1.0 / self.dp_size)  # Megatron's gradient scaling: the reduction averages over ranks
            out = torch.empty(buffer.numel() // self.dp_size, dtype=buffer.dtype, device=buffer.device)
            self._count_transient(out.numel() * out.element_size())
            work = dist.reduce_scatter_tensor(out, buffer, group=self.group, async_op=True)
        self._round.next = index + 1
        self._round.in_flight.append((index, work, buffer, out))
        while len(self._round.in_flight) > 1:
            self._settle(*self._round.in_flight.pop(0))

    def _settle(self, index: int, work: Any, buffer: torch.Tensor, out: torch.Tensor) -> None:
        """Wait for a bucket's reduction, free its full-size buffer, and fold its slice (or hold it until the
        micro-batch's norm is known)."""
        if work is not None:
            work.wait()
            self._count_transient(-buffer.numel() * buffer.element_size())
        del buffer
        if self.clip_grad > 0:
            self._round.held.append((index, out))
        else:
            self._fold(index, out, None)
            self._count_transient(-out.numel() * out.element_size())

    def _end_round(self) -> None:
        """The micro-batch's backward is over: reduce what is left, clip, fold everything, count it."""
        for index in range(self._round.next, len(self.buckets)):
            self._dispatch(index)
        while self._round.in_flight:
            self._settle(*self._round.in_flight.pop(0))
        if self._round.held:
            coefficient = self._clip_coefficient()
            for index, out in self._round.held:
                self._fold(index, out, coefficient)
                self._count_transient(-out.numel() * out.element_size())
        self._round = _Round(len(self.buckets))
        self._rounds += 1
        self._host_checks = False  # a verdict taken before this fold does not cover it

    def _to_f(self) -> float:
        """Factor from an arriving (reduced) gradient to ``∇F_i``, the micro-batch's own mean-loss gradient."""
        return 1.0 if self.scale_by_num_microbatches else float(self.num_microbatches)

    def _clip_coefficient(self) -> torch.Tensor:
        """``min(1, c / (||∇F_i|| + 1e-6))`` over every rank's held slices, as a device value (no host read)."""
        total = torch.stack([self.shards[i].squared_norm(out) for i, out in self._round.held]).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Megatron's distributed optimizer reduces its norm over the whole world (data and tensor parallel).
            dist.all_reduce(total)
        norm = total.sqrt() * self._to_f()
        self._largest_norm = norm if self._largest_norm is None else torch.maximum(self._largest_norm, norm)
        return torch.clamp(self.clip_grad / (norm + _CLIP_EPS), max=1.0)

    def _fold(self, index: int, out: torch.Tensor, coefficient: torch.Tensor | None) -> None:
        shard = self.shards[index]
        g = out if out.dtype == torch.float32 else out.float()
        if coefficient is not None:
            g.mul_(coefficient)
        beta1, beta2 = self.defaults["betas"]
        if self._rounds == 0:  # Algorithm 2's decay, at the mini-batch's first fold
            decay_moments(shard.exp_avg, shard.exp_avg_sq, beta1, beta2)
        fold_gradient(shard.exp_avg, shard.exp_avg_sq, g, beta1, beta2, self._to_f() / self.num_microbatches)

    def _warn_idle(self) -> None:
        if self._warned_idle:
            return
        self._warned_idle = True
        idle = sum(len(b.params) for b in self.buckets) - len(self._round.fired)
        get_logger().warning(
            f"AdamA: {idle} parameter(s) received no gradient in a micro-batch; their buckets are reduced (as "
            "zeros) only when the next micro-batch begins, holding every later bucket's gradients until then. "
            "Freeze such parameters (requires_grad=False) to keep gradient memory to the buckets in flight.")

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Any = None) -> float | None:
        """Finish the mini-batch: update this rank's shards, all-gather the parameters. Returns the largest
        micro-batch gradient norm seen (before clipping) when clipping, else None."""
        if closure is not None:
            raise ValueError("DistributedAdamA.step() takes no closure: gradients are folded during backward")
        if self._round.started:
            self._end_round()
        if self._rounds == 0:
            return None
        if self._rounds != self.num_microbatches:
            raise RuntimeError(
                f"DistributedAdamA.step(): {self._rounds} micro-batches were folded, but num_microbatches="
                f"{self.num_microbatches} was declared; every rank must run N backward passes per step.")
        if not self._host_checks:
            self._check_finite()
        self.step_count += 1
        step = float(self.step_count)
        for shard in self.shards:
            for group_index, s, e in shard.pieces:
                adam_update(shard.theta[s:e], shard.exp_avg[s:e], shard.exp_avg_sq[s:e], step,
                            self.param_groups[group_index])
            if shard.master is not None:
                shard.params.copy_(shard.master)
        self._gather_params()
        largest, self._largest_norm = self._largest_norm, None
        self._rounds, self._host_checks = 0, False
        return None if largest is None else float(largest)

    def _gather_params(self) -> None:
        """Megatron's parameter all-gather: every rank's updated slice into every rank's parameters, in place."""
        if self.dp_size == 1:
            return
        works = [dist.all_gather_into_tensor(s.storage, s.params, group=self.group, async_op=True)
                 for s in self.shards]
        for work in works:
            work.wait()

    def states_finite(self) -> torch.Tensor | None:
        """A device bool: this rank's states are finite (None: nothing folded). The caller reduces it over the
        ranks with its own read and must not call :meth:`step` when any is False (see ``AdamA.states_finite``)."""
        if not self.pending_microbatches:
            return None
        if self._round.started:
            self._end_round()
        self._host_checks = True
        return torch.isfinite(self._state_sum())

    def _state_sum(self) -> torch.Tensor:
        # v >= 0 absorbs every overflow (inf or nan) of m as well, so its sum is a complete check.
        return torch.stack([s.exp_avg_sq.sum() for s in self.shards]).sum()

    def _check_finite(self) -> None:
        finite = torch.isfinite(self._state_sum()).to(torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank raises, or the others would wait
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not bool(finite):
            self._rounds = 0
            raise FloatingPointError(
                "AdamA.step(): a non-finite gradient was folded into the optimizer states during this mini-batch. "
                "AdamA cannot skip the step (the gradients are already merged into m and v); reload the last "
                "checkpoint and lower the learning rate, or clip (--clip-grad).")

    # ------------------------------------------------------------ measurements

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer states: its slices of ``m``, ``v`` and the fp32 master weights."""
        return sum(t.numel() * t.element_size() for s in self.shards for t in s.state_tensors().values())

    # ------------------------------------------------------------ checkpoints

    def layout_signature(self) -> dict[str, Any]:
        """What saved states must match: the data-parallel size and every bucket's size."""
        return {"dp_size": self.dp_size, "buckets": [b.numel for b in self.buckets]}

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters, step count and layout: what every rank shares. This rank's slices of the states are
        :meth:`shard_state`, which the hosts keep per rank (the AdamA extension's state)."""
        if self.pending_microbatches:
            raise RuntimeError("DistributedAdamA.state_dict(): called in the middle of a mini-batch (gradients "
                               "already folded into m and v); a checkpoint taken now could not be resumed exactly. "
                               "Save after step().")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"distributed_adama": self.layout_signature(), "param_groups": groups,
                "step": self.step_count.clone(), "num_microbatches": self.num_microbatches}

    def shard_state(self) -> dict[str, Any]:
        """This rank's slices of ``m``, ``v`` and the master weights, one entry per bucket."""
        return {"layout": self.layout_signature(), "dp_rank": self.dp_rank,
                "slices": [{k: t.clone() for k, t in s.state_tensors().items()} for s in self.shards]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; refuses another layout."""
        self._check_layout(state_dict.get("distributed_adama"))
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ShardMismatch(f"the checkpoint's AdamA has {len(state_dict['param_groups'])} parameter groups, "
                                f"this run {len(self.param_groups)}; resume the model it was saved with")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.step_count = state_dict["step"].clone().float()
        self.num_microbatches = int(state_dict["num_microbatches"])

    def load_shard_state(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`shard_state` bit for bit (this rank's, saved by the same rank of the same layout), and
        the parameters from the master weights."""
        self._check_layout(saved.get("layout"))
        if saved.get("dp_rank") != self.dp_rank:
            raise ShardMismatch(f"these AdamA shards belong to data-parallel rank {saved.get('dp_rank')}, not to "
                                f"rank {self.dp_rank}; load each rank's own shard file")
        with torch.no_grad():
            for shard, tensors in zip(self.shards, saved["slices"]):
                for key, tensor in shard.state_tensors().items():
                    tensor.copy_(tensors[key])
                if shard.master is not None:
                    shard.params.copy_(shard.master)
        self._gather_params()

    def _check_layout(self, saved: Any) -> None:
        mine = self.layout_signature()
        if not isinstance(saved, dict):
            raise ShardMismatch("the checkpoint's AdamA state is not sharded (it was saved without "
                                "--use-distributed-optimizer); resume with the flags it was saved with")
        if saved != mine:
            raise ShardMismatch(
                f"the checkpoint's AdamA shards were saved at data-parallel size {saved.get('dp_size')} with "
                f"buckets of {saved.get('buckets')} elements; this run has {mine['dp_size']} and "
                f"{mine['buckets']}: resume with the data-parallel size and --ddp-bucket-size it was saved with")

    def reload_model_params(self) -> None:
        """Refresh the fp32 master weights from the model's parameters (model weights loaded without these
        states: Megatron-LM's --no-load-optim or --finetune)."""
        with torch.no_grad():
            for shard in self.shards:
                if shard.master is not None:
                    shard.master.copy_(shard.params)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _counted_in_norm(params: list[torch.nn.Parameter]) -> set[int]:
    """Ids of the parameters a global gradient norm counts: Megatron's rule (a tensor-parallel copy or a shared
    embedding's second copy is counted once) where Megatron's model parallelism is set up, else all."""
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared
    except ImportError:
        return {id(p) for p in params}
    if not parallel_state.model_parallel_is_initialized():
        return {id(p) for p in params if param_is_not_shared(p)}
    return {id(p) for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)}


def _warn_large_buckets(buckets: list[Bucket]) -> None:
    total = sum(b.numel for b in buckets)
    largest = max(b.numel for b in buckets)
    if len(buckets) > 1 and largest * 4 <= total:
        return
    get_logger().warning(
        f"AdamA: one gradient bucket holds {largest / total:.0%} of the model's {total:,} gradient elements; AdamA "
        "--use-distributed-optimizer holds about two buckets' gradients at once, so a --ddp-bucket-size well below "
        f"the model (e.g. {max(1, total // 16):,}) saves more memory")


class _Round:
    """The state of one micro-batch's reduction: buckets filling, complete, in flight and (clipping) held."""

    def __init__(self, num_buckets: int) -> None:
        self.fired: set[int] = set()  # ids of the parameters whose gradient arrived
        self.arrived = [0] * num_buckets
        self.filling: dict[int, torch.Tensor] = {}
        self.complete: set[int] = set()
        self.next = 0  # the next bucket to reduce: all ranks reduce them in order
        self.in_flight: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []
        self.held: list[tuple[int, torch.Tensor]] = []

    @property
    def started(self) -> bool:
        return bool(self.fired) or self.next > 0
