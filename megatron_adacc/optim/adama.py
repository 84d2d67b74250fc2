"""AdamA: Adam accumulation (seed 004, Algorithm 2 and Appendix B).

Gradient accumulation keeps a whole-model gradient buffer alive until the last micro-batch. AdamA instead
folds every micro-batch gradient into Adam's moments the moment autograd has produced it, and releases the
gradient right away, so no gradient buffer persists across micro-batches (and at most the gradients of the
layers in flight exist during one backward).

For a mini-batch of ``N`` micro-batches with gradients ``∇f_i`` (each the gradient of that micro-batch's
mean loss), with ``g_i = ∇f_i / N``::

    at the first gradient of the mini-batch:  m <- beta1 * m,      v <- beta2 * v
    for every micro-batch i (during backward): m += (1 - beta1) g_i, v += (1 - beta2) g_i^2
    step():  m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)
             theta -= lr * m_hat / (sqrt(v_hat) + eps)      (+ optional weight decay)

So ``m`` equals the ``m`` of Adam over the accumulated gradient, while ``v`` holds the sum of squared
micro-batch gradients instead of the square of their sum (the one intended difference from Adam). With
``N = 1`` the update is Adam's (``decoupled_weight_decay=True``: AdamW's).

Micro-batch boundaries
----------------------
A mini-batch is everything folded between two :meth:`AdamA.step` calls. Autograd's post-accumulate-grad
hooks do the folding, so the loop is the usual one::

    opt = AdamA(model.parameters(), lr=1e-3, num_microbatches=N)
    for batch in loader:
        opt.zero_grad()                   # optional: checks no gradient is pending (or begin_minibatch(N))
        for micro in split(batch, N):
            loss_fn(model(micro)).backward()     # mean loss of the micro-batch, NOT divided by N
        opt.step()

If the loop already divides each micro-batch loss by ``N`` (as Megatron's schedules do), construct the
optimizer with ``scale_by_num_microbatches=False``. Gradients are never left in ``param.grad``; code that
needs a gradient without folding it (a probe) runs its backward inside :meth:`AdamA.accumulation_paused`.

Data parallel (Appendix B)
--------------------------
With ``data_parallel_group`` of ``M`` ranks, each rank folds its own ``N`` micro-batches with ``v`` decayed
by ``M * beta2`` instead of ``beta2``; :meth:`step` sum-all-reduces ``m`` and ``v`` once per mini-batch and
divides ``m`` by ``M`` and ``v`` by ``M^2``. The result equals single-device AdamA over ``N * M``
micro-batches, while communication stays one all-reduce of the optimizer states per mini-batch. The states
sharded across the ranks instead (Megatron's distributed optimizer) are
:class:`~megatron_adacc.optim.distributed.DistributedAdamA`.

Precision, loss scaling and clipping
------------------------------------
* Parameters that are not fp32 (bf16/fp16 models) get an fp32 master copy in the optimizer state; ``m``,
  ``v`` and the update are fp32, and the model parameter is refreshed from the master after each step.
* ``loss_scale`` (static) divides every gradient before it is folded. Dynamic loss scaling cannot work:
  a micro-batch that overflows has already been folded into ``m`` and ``v`` when the overflow is seen,
  and the moments cannot be rolled back. :meth:`step` therefore checks that ``v`` is finite and raises
  :class:`FloatingPointError` otherwise (the states are poisoned; restore a checkpoint).
* Clipping by the global norm of the mini-batch gradient is impossible: that gradient never exists.
  ``clip_grad_per_tensor=c`` instead clips each micro-batch gradient of each parameter tensor to L2 norm
  ``c`` (measured on ``∇f_i``, after unscaling and before the ``1/N`` factor) as it is folded. The sharded form
  clips each micro-batch's gradient by its global norm (:mod:`megatron_adacc.optim.distributed`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AdamA", "adam_update", "decay_moments", "fold_gradient"]

_STATE_KEYS_FP32 = ("exp_avg", "exp_avg_sq", "master_param")


def decay_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, beta1: float, v_decay: float) -> None:
    """Algorithm 2's decay at the start of a mini-batch: ``m <- beta1 m``, ``v <- v_decay v`` (``beta2``, or
    ``M beta2`` in Appendix B's data parallel)."""
    exp_avg.mul_(beta1)
    exp_avg_sq.mul_(v_decay)


def fold_gradient(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float,
                  scale: float) -> None:
    """Algorithm 2's fold of one micro-batch gradient ``g_i = scale * g`` (fp32):
    ``m += (1 - beta1) g_i``, ``v += (1 - beta2) g_i^2``."""
    exp_avg.add_(g, alpha=(1.0 - beta1) * scale)
    exp_avg_sq.addcmul_(g, g, value=(1.0 - beta2) * scale * scale)


def adam_update(theta: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float,
                group: dict[str, Any]) -> None:
    """Adam's bias-corrected update of ``theta`` at step ``step`` from the group's ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` (applied first and decoupled, AdamW's, when ``decoupled_weight_decay``)."""
    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    if wd != 0.0 and group["decoupled_weight_decay"]:
        theta.mul_(1.0 - lr * wd)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
    theta.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class AdamA(torch.optim.Optimizer):
    """Adam whose micro-batch gradients are folded into ``m`` and ``v`` during backward and then freed.

    Args:
        params: parameters or parameter groups, as for :class:`torch.optim.Adam`.
        lr, betas, eps, weight_decay: as for :class:`torch.optim.Adam`.
        decoupled_weight_decay: ``True`` applies AdamW's decoupled decay at the step; ``False`` adds the
            L2 term ``weight_decay * theta`` to every micro-batch gradient (Adam's coupled decay).
        num_microbatches: ``N``, the micro-batches folded per mini-batch on this rank.
        scale_by_num_microbatches: divide each gradient by ``N`` (Algorithm 2's ``g = ∇f / N``). Pass
            ``False`` when each micro-batch loss is already divided by ``N``.
        loss_scale: static loss scale to divide gradients by (``1.0``: none).
        clip_grad_per_tensor: if set, clip each micro-batch gradient of each tensor to this L2 norm.
        data_parallel_group: process group whose ranks train data-parallel replicas (Appendix B);
            ``None`` means no synchronisation.
        strict_microbatch_count: raise at :meth:`step` if a parameter received a number of gradients
            other than ``N`` (``0`` is always allowed: the parameter is skipped, like Adam skips
            ``grad=None``). Turn off for models whose parameters take part in only some micro-batches.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        num_microbatches: int = 1,
        scale_by_num_microbatches: bool = True,
        loss_scale: float = 1.0,
        clip_grad_per_tensor: float | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        strict_microbatch_count: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"AdamA: invalid learning rate {lr} (must be >= 0)")
        if eps < 0.0:
            raise ValueError(f"AdamA: invalid eps {eps} (must be >= 0)")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamA: invalid betas {betas} (each must be in [0, 1))")
        if weight_decay < 0.0:
            raise ValueError(f"AdamA: invalid weight_decay {weight_decay} (must be >= 0)")
        if not (loss_scale > 0.0 and math.isfinite(loss_scale)):
            raise ValueError(f"AdamA: loss_scale must be a positive finite number, got {loss_scale}")
        if clip_grad_per_tensor is not None and not clip_grad_per_tensor > 0.0:
            raise ValueError(
                f"AdamA: clip_grad_per_tensor must be > 0 or None, got {clip_grad_per_tensor}"
            )
        defaults = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        self._hook_handles: list[Any] = []
        self._folds: dict[torch.Tensor, int] = {}
        self._host_checks = False  # states_finite() handed the caller the finiteness check of this step
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        self._paused = 0
        self.num_microbatches = self._check_n(num_microbatches)
        self.scale_by_num_microbatches = scale_by_num_microbatches
        self.loss_scale = float(loss_scale)
        self.clip_grad_per_tensor = clip_grad_per_tensor
        self.strict_microbatch_count = strict_microbatch_count
        self.data_parallel_group = data_parallel_group
        self._dp_size = 1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _check_n(n: int) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"AdamA: num_microbatches must be a positive int, got {n!r}")
        return n

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group and hook its parameters so their gradients are folded during backward."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if p.is_sparse:
                raise ValueError("AdamA does not support sparse parameters")
            self._group_of[p] = group
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._fold_hook))

    def remove_hooks(self) -> None:
        """Detach from autograd (gradients then stay in ``.grad`` like with any optimizer)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()

    # ------------------------------------------------------- mini-batch protocol

    @property
    def pending_folds(self) -> int:
        """Number of (parameter, micro-batch) gradients folded since the last :meth:`step`."""
        return sum(self._folds.values())

    def begin_minibatch(self, num_microbatches: int | None = None) -> None:
        """Start a mini-batch (optionally of a new size ``N``).

        The decay ``m <- beta1 m, v <- beta2 v`` is applied lazily at each parameter's first gradient, so
        this call does not touch the states; it only checks that no gradient is pending.
        """
        if self._folds:
            raise RuntimeError(
                f"AdamA: a new mini-batch was started while {self.pending_folds} micro-batch gradients are "
                "already folded into m and v; they cannot be discarded. Call step() to finish the "
                "mini-batch first."
            )
        if num_microbatches is not None:
            self.num_microbatches = self._check_n(num_microbatches)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new mini-batch: same as :meth:`begin_minibatch` with the current ``N``.

        ``set_to_none=False`` is accepted for API compatibility; AdamA never keeps gradients, so any
        ``.grad`` left over (from a paused backward) is dropped either way.
        """
        self.begin_minibatch()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @contextlib.contextmanager
    def accumulation_paused(self) -> Iterator[None]:
        """Backward passes inside this context leave gradients in ``.grad`` instead of folding them.

        For probes that need a real gradient (e.g. a sensitivity estimate). Clear the gradients (e.g.
        :meth:`zero_grad`) before the next :meth:`step`, which refuses unfolded gradients.
        """
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def fold_grads(self) -> None:
        """Fold the gradients currently held in ``.grad`` as one micro-batch, and free them.

        For gradients produced outside autograd's hooks (assigned by hand, or computed while paused).
        """
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._fold(p)

    # --------------------------------------------------------------- folding

    def _fold_hook(self, p: torch.Tensor) -> None:
        if self._paused:
            return
        self._fold(p)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(
                p, dtype=torch.float32, memory_format=torch.preserve_format
            )
            if p.dtype != torch.float32:
                state["master_param"] = p.detach().to(torch.float32, copy=True)
        return state

    @torch.no_grad()
    def _fold(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError("AdamA does not support sparse gradients")
        group = self._group_of[p]
        beta1, beta2 = group["betas"]
        state = self._init_state(p)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        count = self._folds.get(p, 0)
        if count == 0:
            # Algorithm 2's decay at the start of the mini-batch, done at the parameter's first gradient so
            # parameters that get no gradient are left untouched (like torch.optim.Adam skips grad=None).
            # Appendix B: in data parallel, v is decayed by M * beta2 and the sum over ranks divided by M^2.
            decay_moments(exp_avg, exp_avg_sq, beta1, beta2 * self._dp_size)
        g = grad if grad.dtype == torch.float32 else grad.to(torch.float32)
        # to_f converts the arriving gradient into ∇f_i (the micro-batch's own mean-loss gradient): undo the
        # loss scale, and the 1/N the loop applied itself when scale_by_num_microbatches is False.
        to_f = 1.0 / self.loss_scale
        if not self.scale_by_num_microbatches:
            to_f *= self.num_microbatches
        scale = to_f / self.num_microbatches  # g_i = ∇f_i / N = grad * scale
        wd = group["weight_decay"]
        if wd != 0.0 and not group["decoupled_weight_decay"]:
            # Coupled (L2) decay: wd * theta belongs to every micro-batch loss, so it joins ∇f_i and is scaled
            # by 1/N with it (summing to wd * theta per mini-batch, as in Adam on the accumulated gradient).
            g = g.add(state.get("master_param", p), alpha=wd / to_f)
        if self.clip_grad_per_tensor is not None:
            # The factor stays a tensor so no device sync is forced per parameter.
            f_norm = torch.linalg.vector_norm(g) * to_f
            g = g * torch.clamp(self.clip_grad_per_tensor / (f_norm + 1e-6), max=1.0)
        fold_gradient(exp_avg, exp_avg_sq, g, beta1, beta2, scale)
        self._folds[p] = count + 1
        self._host_checks = False  # a verdict taken before this fold does not cover it
        # Release: the only reference autograd kept is .grad; dropping it frees the buffer now.
        p.grad = None
        del grad, g

    # ------------------------------------------------------------------ step

    def _check_no_unfolded_grads(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    raise RuntimeError(
                        f"AdamA.step(): a parameter of shape {tuple(p.shape)} holds a .grad that was never "
                        "folded into m and v. AdamA folds gradients with autograd hooks during backward; "
                        "for gradients assigned by hand call fold_grads() before step(), and clear "
                        "gradients computed under accumulation_paused() with zero_grad()."
                    )

    def _fold_counts(self, params: list[torch.Tensor]) -> list[int]:
        local = [self._folds.get(p, 0) for p in params]
        if self.data_parallel_group is None or self._dp_size == 1:
            return local
        counts = torch.tensor(local, dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.data_parallel_group)
        return counts.tolist()

    def _check_counts(self, params: list[torch.Tensor], counts: list[int]) -> None:
        if not self.strict_microbatch_count:
            return
        expected = self.num_microbatches * self._dp_size
        for p, c in zip(params, counts):
            if c not in (0, expected):
                where = f" summed over {self._dp_size} ranks" if self._dp_size > 1 else ""
                raise RuntimeError(
                    f"AdamA.step(): a parameter of shape {tuple(p.shape)} received {c} micro-batch gradients"
                    f"{where}, but num_microbatches={self.num_microbatches} (x {self._dp_size} ranks) was "
                    "declared. Set N with begin_minibatch(N) / num_microbatches=N, or pass "
                    "strict_microbatch_count=False if parameters legitimately skip micro-batches."
                )

    def _all_reduce_states(self, params: list[torch.Tensor], counts: list[int]) -> None:
        """Appendix B: m averaged over ranks, v summed and divided by M^2 (one all-reduce per state)."""
        m_ranks = self._dp_size
        handles = []
        synced = []
        for p, c in zip(params, counts):
            if c == 0:
                continue
            state = self._init_state(p)
            if self._folds.get(p, 0) == 0:
                # Another rank folded gradients for this parameter; this rank contributes zero gradient
                # but must still apply its share of the decay.
                group = self._group_of[p]
                state["exp_avg"].mul_(group["betas"][0])
                state["exp_avg_sq"].mul_(group["betas"][1] * m_ranks)
            for key in ("exp_avg", "exp_avg_sq"):
                handles.append(
                    dist.all_reduce(state[key], op=dist.ReduceOp.SUM, group=self.data_parallel_group,
                                    async_op=True)
                )
            synced.append(state)
        for h in handles:
            h.wait()
        for state in synced:
            state["exp_avg"].div_(m_ranks)
            state["exp_avg_sq"].div_(m_ranks * m_ranks)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Finish the mini-batch: (data-parallel sync,) bias-corrected update, reset for the next one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_no_unfolded_grads()
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        counts = self._fold_counts(params)
        self._check_counts(params, counts)
        if self.data_parallel_group is not None and self._dp_size > 1:
            self._all_reduce_states(params, counts)
        updated = [(p, self._group_of[p]) for p, c in zip(params, counts) if c > 0]
        if not self._host_checks:
            self._check_finite(updated)
        for p, group in updated:
            self._update(p, group)
        self._folds.clear()
        self._host_checks = False
        return loss

    def states_finite(self) -> torch.Tensor | None:
        """A device bool: every state this mini-batch folded into is finite (None: nothing folded yet).

        Nothing is read. The caller takes over the check :meth:`step` makes otherwise (a host read, a sync on a
        GPU): it reads this with what it reads anyway and must not call :meth:`step` when it is False (the
        training loop stops the run then, as AdamA cannot skip a step). Folding another gradient cancels that."""
        updated = [p for p in self._folds if self._folds[p] > 0]
        if not updated:
            return None
        self._host_checks = True
        return torch.isfinite(self._state_sum(updated))

    def _state_sum(self, params: list[torch.Tensor]) -> torch.Tensor:
        # v >= 0 absorbs every overflow (inf or nan) of m as well, so its sum is a complete check.
        return torch.stack([self.state[p]["exp_avg_sq"].sum() for p in params]).sum()

    def _check_finite(self, updated: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        if not updated:
            return
        total = self._state_sum([p for p, _ in updated])
        if not torch.isfinite(total):
            self._folds.clear()
            raise FloatingPointError(
                "AdamA.step(): a non-finite gradient was folded into the optimizer states during this "
                "mini-batch. AdamA cannot skip the step as dynamic loss scaling would (the gradients are "
                "already merged into m and v), so the states are unusable: reload the last checkpoint "
                "and lower the learning rate, use bf16 instead of fp16, or set a smaller static loss_scale."
            )

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] += 1
        theta = state.get("master_param", p)
        adam_update(theta, state["exp_avg"], state["exp_avg_sq"], float(state["step"]), group)
        if theta is not p:
            p.copy_(theta)

    def state_bytes(self) -> int:
        """Bytes of the optimizer states: ``m``, ``v`` and the fp32 master weights of every parameter."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for k, t in st.items()
                   if k in _STATE_KEYS_FP32)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 master weights from the parameters (after model weights were loaded on their own)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if "master_param" in state:
                    state["master_param"].copy_(p.detach().float())

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state dict plus ``num_microbatches``; refuses while a mini-batch is open."""
        if self._folds:
            raise RuntimeError(
                "AdamA.state_dict(): called in the middle of a mini-batch (gradients already folded into "
                "m and v); a checkpoint taken now could not be resumed exactly. Save after step()."
            )
        sd = super().state_dict()
        sd["adama"] = {"num_microbatches": self.num_microbatches, "dp_size": self._dp_size}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore m, v, master weights and step counts bit-exactly (kept in fp32 whatever the params)."""
        sd = dict(state_dict)
        extra = sd.pop("adama", None)
        saved_state = sd["state"]
        super().load_state_dict(sd)
        # torch casts floating state to the parameter's dtype on load; AdamA's states are fp32 by design.
        index_to_param = {
            i: p for i, p in enumerate(p for g in self.param_groups for p in g["params"])
        }
        for idx, st in saved_state.items():
            p = index_to_param[int(idx)]
            for key in _STATE_KEYS_FP32:
                if key in st:
                    self.state[p][key] = st[key].to(device=p.device, dtype=torch.float32, copy=True)
        # Re-point the fold bookkeeping at the (possibly rebuilt) group dicts.
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._group_of:
                    self._group_of[p] = group
        self._folds.clear()
        if extra is not None:
            self.num_microbatches = self._check_n(int(extra["num_microbatches"]))
