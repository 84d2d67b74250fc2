"""AdamA inside a megatron-core training loop (``adacc train --adama``).

Megatron's ``DistributedDataParallel`` allocates a persistent, contiguous fp32 ``main_grad`` buffer for the
whole model and adds every micro-batch gradient into it; keeping that buffer would leave AdamA with nothing
to save. :func:`setup_adama` therefore does not wrap the model with Megatron DDP at all: AdamA's
post-accumulate-grad hooks fold each parameter's gradient into ``m`` and ``v`` and free it, and data
parallelism is AdamA's own once-per-mini-batch all-reduce of ``m`` and ``v`` over Megatron's data-parallel
group (seed 004, Appendix B).

The returned optimizer quacks like a Megatron optimizer where a training loop touches it::

    optimizer.zero_grad()                       # starts a mini-batch
    for micro in range(N): forward; backward    # gradients are folded and freed inside backward
    ok, grad_norm, num_zeros = optimizer.step()

``N = global_batch_size / (micro_batch_size * data_parallel_size)``. As in Megatron's schedules (and
``adacc train``), each micro-batch's backward is expected on its loss divided by ``N``, which is Algorithm 2's
``g = ∇f / N``; pass ``loss_divided_by_num_microbatches=False`` to a loop that backpropagates undivided
losses, and AdamA applies the ``1/N`` itself.

What is refused, and why (each with the fix in the error):

* ``--clip-grad > 0``: global-norm clipping needs the whole mini-batch gradient, which never exists under
  AdamA. Use ``--clip-grad 0``, optionally with per-tensor clipping of each micro-batch gradient
  (``adama_clip_grad_per_tensor`` on the args).
* fp16 (dynamic loss scaling): an overflowing micro-batch is already folded into ``m``/``v`` when it is
  detected, so the step cannot be skipped. Use ``--bf16`` (no loss scaling needed).
* ``--use-distributed-optimizer`` / ``--overlap-grad-reduce``: these are properties of Megatron's DDP
  gradient buffer, which AdamA replaces.
* pipeline parallelism, sequence parallelism, MoE and ``gradient_accumulation_fusion``: their gradients
  need Megatron's cross-rank gradient reductions (or the ``main_grad`` buffer) before they are final.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.optim.adama import AdamA

__all__ = ["MegatronAdamA", "adama_param_groups", "check_supported", "num_microbatches", "setup_adama"]

# Megatron's OptimizerConfig defaults (adam_beta1, adam_beta2, adam_eps).
_DEFAULT_BETAS = (0.9, 0.999)
_DEFAULT_EPS = 1e-8


class MegatronAdamA:
    """A Megatron-optimizer-shaped facade over :class:`AdamA` (what ``adacc train`` calls)."""

    #: Gradients are folded into the moments during backward: a step can no longer be skipped after it.
    folds_gradients = True

    def __init__(self, optimizer: AdamA, model_chunks: list[torch.nn.Module]) -> None:
        self.optimizer = optimizer
        self.model_chunks = model_chunks

    # -- the loop's protocol
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor([1.0])

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a mini-batch (no gradient buffer exists, so nothing is zeroed)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> tuple[bool, float | None, int | None]:
        """Apply the update; returns Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)``.

        ``grad_norm`` is ``None``: the mini-batch gradient whose norm Megatron reports never exists.
        A non-finite gradient raises :class:`FloatingPointError` instead of returning ``False``, because
        unlike Megatron's optimizers AdamA cannot skip the step (see :mod:`megatron_adacc.optim.adama`).
        """
        self.optimizer.step()
        return True, None, None

    def states_finite(self) -> torch.Tensor | None:
        """A device bool for the host's per-step finiteness check, which then replaces the one :meth:`step`
        would read (see ``AdamA.states_finite``)."""
        return self.optimizer.states_finite()

    def accumulation_paused(self) -> contextlib.AbstractContextManager:
        """Backward passes inside leave gradients in ``.grad`` (probes); see ``AdamA.accumulation_paused``.

        The next :meth:`zero_grad` drops such gradients.
        """
        return self.optimizer.accumulation_paused()

    def get_parameters(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def reload_model_params(self, state_dict: Any = None) -> None:
        """Refresh the fp32 master weights from the model's parameters (after loading model weights)."""
        with torch.no_grad():
            for p in self.get_parameters():
                st = self.optimizer.state.get(p, {})
                if "master_param" in st:
                    st["master_param"].copy_(p.detach().float())

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise NotImplementedError(
            "AdamA checkpoints are plain torch state dicts (state_dict()/load_state_dict()); Megatron's "
            "distributed checkpoint format (sharded_state_dict) is not implemented for --adama."
        )


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def data_parallel_size() -> int:
    # megatron-core is imported in the functions: check_supported is --adama's preflight, and a refused
    # command line fails before megatron-core loads.
    from megatron.core import parallel_state

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return 1
    return parallel_state.get_data_parallel_world_size()


def num_microbatches(args: Any, dp_size: int) -> int:
    """``N = global_batch_size / (micro_batch_size x data-parallel size)``, refusing a remainder."""
    micro = _arg(args, "micro_batch_size")
    glob = _arg(args, "global_batch_size", None)
    if micro is None or micro < 1:
        raise ValueError(f"--adama needs a positive --micro-batch-size, got {micro}")
    if glob is None:
        return 1
    per_step = micro * dp_size
    if glob % per_step != 0:
        raise ValueError(
            f"--global-batch-size {glob} is not a multiple of --micro-batch-size {micro} x data-parallel "
            f"size {dp_size} = {per_step}; AdamA needs a whole number of micro-batches per rank."
        )
    return glob // per_step


def check_supported(args: Any, config: Any = None) -> None:
    """Raise :class:`~megatron_adacc.core.errors.IntegrationError` (a ``ValueError``) naming the flag to change
    for any combination AdamA cannot honour."""
    clip = _arg(args, "clip_grad", 0.0)
    if clip and clip > 0:
        raise IntegrationError(
            f"--adama cannot clip by the global gradient norm (--clip-grad {clip}): the mini-batch gradient "
            "is never materialised (each micro-batch gradient is folded into Adam's moments and freed during "
            "backward). Pass --clip-grad 0; to bound outliers, clip each parameter's micro-batch gradient "
            "instead (--adama-clip-grad-per-tensor C; AdamA(clip_grad_per_tensor=C) from Python)."
        )
    if _arg(args, "fp16", False) or (config is not None and getattr(config, "fp16", False)):
        raise IntegrationError(
            "--adama does not support --fp16: dynamic loss scaling skips steps whose gradients overflow, but "
            "AdamA has already folded them into m and v when the overflow is found. Use --bf16."
        )
    for flag, attr in (("--use-distributed-optimizer", "use_distributed_optimizer"),
                       ("--overlap-grad-reduce", "overlap_grad_reduce")):
        if _arg(args, attr, False):
            raise IntegrationError(
                f"--adama replaces Megatron's DDP gradient buffer, so {flag} (a mode of that buffer) has no "
                f"meaning with it; drop {flag}. AdamA all-reduces m and v once per mini-batch instead."
            )
    if config is not None:
        if getattr(config, "pipeline_model_parallel_size", 1) > 1:
            raise IntegrationError("--adama supports pipeline-model-parallel size 1 only (tied embedding gradients "
                             "would need Megatron's cross-stage reduction before folding).")
        if getattr(config, "sequence_parallel", False):
            raise IntegrationError("--adama does not support --sequence-parallel (layer-norm gradients need "
                             "Megatron's tensor-parallel all-reduce before they are final).")
        if getattr(config, "num_moe_experts", None):
            raise IntegrationError("--adama does not support MoE models (expert gradients reduce over the expert "
                             "data-parallel group).")
        if getattr(config, "gradient_accumulation_fusion", False):
            raise IntegrationError("--adama needs gradient_accumulation_fusion off "
                             "(--no-gradient-accumulation-fusion): the fused wgrad GEMM writes into "
                             "Megatron DDP's main_grad buffer, which AdamA does not allocate.")


def adama_param_groups(model_chunks: list[torch.nn.Module], lr: float, min_lr: float | None
                       ) -> list[dict[str, Any]]:
    """Megatron's standard grouping: no weight decay on biases and 1-D parameters (``wd_mult`` 0).

    Groups carry Megatron's scheduler keys (``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``), so
    ``OptimizerParamScheduler`` or a loop that writes ``lr``/``weight_decay`` drives them unchanged.
    """
    decay, no_decay = [], []
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    common = {"lr_mult": 1.0, "max_lr": lr, "min_lr": min_lr if min_lr is not None else lr,
              "is_expert_parallel": False, "is_decoupled_lr": False, "default_config": True}
    groups = [{"params": decay, "wd_mult": 1.0, **common}, {"params": no_decay, "wd_mult": 0.0, **common}]
    return [g for g in groups if g["params"]]


def _broadcast_params(model_chunks: list[torch.nn.Module], group: Any) -> None:
    """Make every data-parallel replica start from the same weights (Megatron DDP relies on seeds alone;
    AdamA's m/v all-reduce assumes identical parameters, so enforce it)."""
    src = torch.distributed.get_global_rank(group, 0)
    with torch.no_grad():
        for chunk in model_chunks:
            for p in chunk.parameters():
                torch.distributed.broadcast(p.data, src=src, group=group)


def setup_adama(args: Any, model_chunks: list[torch.nn.Module], config: Any = None, *,
                loss_divided_by_num_microbatches: bool = True,
                ) -> tuple[list[torch.nn.Module], MegatronAdamA]:
    """Build AdamA for bare (not DDP-wrapped) megatron-core model chunks.

    Args:
        args: parsed ``adacc train`` / Megatron-LM arguments (``lr``, ``min_lr``, ``weight_decay``,
            ``micro_batch_size``, ``global_batch_size``, ``clip_grad``, ``bf16``; optional ``adam_beta1``,
            ``adam_beta2``, ``adam_eps``, ``adama_clip_grad_per_tensor``).
        model_chunks: the models (``GPTModel`` or ``Float16Module``); they must *not* be wrapped in Megatron
            DDP, whose gradient buffer is exactly what AdamA removes.
        config: the ``TransformerConfig`` (checked for unsupported parallel modes).
        loss_divided_by_num_microbatches: whether the loop divides each micro-batch loss by ``N``.

    Returns the model chunks to train (unchanged) and the optimizer.
    """
    check_supported(args, config)
    from megatron.core.distributed import DistributedDataParallel  # see data_parallel_size

    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            raise TypeError(
                "setup_adama() got a Megatron DistributedDataParallel wrapper: its persistent gradient "
                "buffer is already allocated, so AdamA would save nothing. Pass the bare model chunks."
            )
    dp_size = data_parallel_size()
    group = None
    if dp_size > 1:
        from megatron.core import parallel_state  # see data_parallel_size

        group = parallel_state.get_data_parallel_group()
        _broadcast_params(model_chunks, group)
    n = num_microbatches(args, dp_size)
    lr = float(_arg(args, "lr", 1e-3))
    optimizer = AdamA(
        adama_param_groups(model_chunks, lr, _arg(args, "min_lr", None)),
        lr=lr,
        betas=(float(_arg(args, "adam_beta1", _DEFAULT_BETAS[0])),
               float(_arg(args, "adam_beta2", _DEFAULT_BETAS[1]))),
        eps=float(_arg(args, "adam_eps", _DEFAULT_EPS)),
        weight_decay=float(_arg(args, "weight_decay", 0.0)),
        decoupled_weight_decay=True,  # Megatron's Adam is AdamW
        num_microbatches=n,
        scale_by_num_microbatches=not loss_divided_by_num_microbatches,
        clip_grad_per_tensor=_arg(args, "adama_clip_grad_per_tensor", None),
        data_parallel_group=group,
    )
    # Megatron's scheduler keys are set on the groups; apply wd_mult to the initial weight decay.
    for g in optimizer.param_groups:
        g["weight_decay"] = g["weight_decay"] * g.get("wd_mult", 1.0)
    return model_chunks, MegatronAdamA(optimizer, model_chunks)
