"""AdamA inside a megatron-core training loop (``adacc train --adama``, ``pretrain_gpt.py --adama``).

Megatron's ``DistributedDataParallel`` allocates a persistent, contiguous fp32 ``main_grad`` buffer for the
whole model and adds every micro-batch gradient into it; keeping that buffer would leave AdamA with nothing
to save. :func:`setup_adama` therefore does not wrap the model with Megatron DDP at all: AdamA's
post-accumulate-grad hooks fold each parameter's gradient into ``m`` and ``v`` and free it. Data parallelism
takes one of two forms:

* replicated states (default): every rank folds its own micro-batches and AdamA all-reduces ``m`` and ``v``
  once per mini-batch over Megatron's data-parallel group (seed 004, Appendix B): AdamA over ``N x M``
  micro-batches;
* ``--use-distributed-optimizer``: ``m``, ``v`` and the fp32 master weights are sharded as Megatron's distributed
  optimizer shards them, each micro-batch's gradient is reduce-scattered bucket by bucket during backward and
  folded by the rank that owns it, and the parameters are all-gathered after the step
  (:class:`~megatron_adacc.optim.distributed.DistributedAdamA`): AdamA over ``N`` micro-batches of ``M x b``
  samples, Adam for ``N = 1``; ``--clip-grad`` clips each micro-batch's gradient by its global norm.

The returned optimizer quacks like a Megatron optimizer where a training loop touches it::

    optimizer.zero_grad()                       # starts a mini-batch
    for micro in range(N): forward; backward    # gradients are folded and freed inside backward
    ok, grad_norm, num_zeros = optimizer.step()

``N = global_batch_size / (micro_batch_size * data_parallel_size)``. As in Megatron's schedules (and
``adacc train``), each micro-batch's backward is expected on its loss divided by ``N``, which is Algorithm 2's
``g = ∇f / N``; pass ``loss_divided_by_num_microbatches=False`` to a loop that backpropagates undivided
losses, and AdamA applies the ``1/N`` itself.

What is refused, and why (each with the fix in the error): see :func:`check_supported`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.optim.adama import AdamA
from megatron_adacc.optim.distributed import DistributedAdamA
from megatron_adacc.optim.layout import default_bucket_size

__all__ = ["MegatronAdamA", "MegatronDistributedAdamA", "adama_param_groups", "check_supported", "num_microbatches",
           "setup_adama"]

# Megatron's OptimizerConfig defaults (adam_beta1, adam_beta2, adam_eps).
_DEFAULT_BETAS = (0.9, 0.999)
_DEFAULT_EPS = 1e-8


class MegatronAdamA:
    """A Megatron-optimizer-shaped facade over :class:`AdamA` (what ``adacc train`` calls)."""

    #: Gradients are folded into the moments during backward: a step can no longer be skipped after it.
    folds_gradients = True

    def __init__(self, optimizer: AdamA | DistributedAdamA, model_chunks: list[torch.nn.Module]) -> None:
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
        self.optimizer.reload_model_params()

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


class MegatronDistributedAdamA(MegatronAdamA):
    """The facade over :class:`DistributedAdamA` (``--adama --use-distributed-optimizer``): its step reports the
    largest micro-batch gradient norm when clipping, and its checkpoints hold this rank's shards."""

    optimizer: DistributedAdamA

    def step(self) -> tuple[bool, float | None, int | None]:
        """As :meth:`MegatronAdamA.step`; ``grad_norm`` is, with ``--clip-grad``, the largest global norm of the
        step's micro-batch gradients before clipping (Megatron's grad norm when ``N = 1``), else ``None``."""
        return True, self.optimizer.step(), None


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
    _check_clipping(args)
    if _arg(args, "fp16", False) or (config is not None and getattr(config, "fp16", False)):
        raise IntegrationError(
            "--adama does not support --fp16: dynamic loss scaling skips steps whose gradients overflow, but "
            "AdamA has already folded them into m and v when the overflow is found. Use --bf16."
        )
    if _arg(args, "use_distributed_optimizer", False):
        if _arg(args, "overlap_param_gather", False):
            raise IntegrationError(
                "--adama --use-distributed-optimizer all-gathers the updated parameters at the end of its step; "
                "overlapping that gather with the next forward is not implemented: drop --overlap-param-gather")
    elif _arg(args, "overlap_grad_reduce", False):
        raise IntegrationError(
            "--adama without --use-distributed-optimizer reduces no gradients (it all-reduces m and v once per "
            "mini-batch), so --overlap-grad-reduce has no meaning: drop it, or add --use-distributed-optimizer, "
            "whose gradient reductions always overlap backward")
    if config is not None:
        _check_parallelism(args, config)


def _check_clipping(args: Any) -> None:
    clip = _arg(args, "clip_grad", 0.0)
    distributed = _arg(args, "use_distributed_optimizer", False)
    if clip and clip > 0 and not distributed:
        raise IntegrationError(
            f"--adama clips by the global gradient norm (--clip-grad {clip}) only with --use-distributed-optimizer, "
            "which clips each micro-batch's reduced gradient by its global norm before folding it (the mini-batch "
            "gradient never exists); add --use-distributed-optimizer, or pass --clip-grad 0 (per-tensor "
            "clipping of each micro-batch gradient: --adama-clip-grad-per-tensor C)."
        )
    if distributed and _arg(args, "adama_clip_grad_per_tensor", None) is not None:
        raise IntegrationError(
            "--adama-clip-grad-per-tensor needs whole tensors on one rank, but --use-distributed-optimizer gives "
            "each rank slices of them; clip by the micro-batch's global norm instead: --clip-grad C")


def _check_parallelism(args: Any, config: Any) -> None:
    """The parallel modes whose gradients need Megatron's cross-rank reductions before they are final."""
    if (getattr(config, "pipeline_model_parallel_size", 1) or 1) > 1 and \
            not _arg(args, "untie_embeddings_and_output_weights", False):
        raise IntegrationError(
            "--adama under pipeline parallelism needs --untie-embeddings-and-output-weights: tied, the word "
            "embeddings' gradient is the first stage's plus the last stage's, which Megatron adds across the stages "
            "after the step's last backward, while AdamA folds every micro-batch's gradient as backward makes it; "
            "add --untie-embeddings-and-output-weights, or use --pipeline-model-parallel-size 1.")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise IntegrationError("--adama supports --context-parallel-size 1 only (each sequence's gradient is summed "
                               "over the context-parallel ranks before it is final).")
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
            ``adam_beta2``, ``adam_eps``, ``adama_clip_grad_per_tensor``, ``use_distributed_optimizer``,
            ``ddp_bucket_size``, ``accumulate_allreduce_grads_in_fp32``).
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
    lr = float(_arg(args, "lr", 1e-3))
    common = dict(lr=lr, betas=(float(_arg(args, "adam_beta1", _DEFAULT_BETAS[0])),
                                float(_arg(args, "adam_beta2", _DEFAULT_BETAS[1]))),
                  eps=float(_arg(args, "adam_eps", _DEFAULT_EPS)), weight_decay=float(_arg(args, "weight_decay", 0.0)),
                  num_microbatches=num_microbatches(args, dp_size),
                  scale_by_num_microbatches=not loss_divided_by_num_microbatches, data_parallel_group=group)
    groups = adama_param_groups(model_chunks, lr, _arg(args, "min_lr", None))
    if _arg(args, "use_distributed_optimizer", False):
        reduce_in_fp32 = _arg(args, "accumulate_allreduce_grads_in_fp32", True)
        optimizer: AdamA | DistributedAdamA = DistributedAdamA(
            groups, **common, clip_grad=float(_arg(args, "clip_grad", 0.0)),
            bucket_size=_arg(args, "ddp_bucket_size", None) or default_bucket_size(dp_size),
            grad_reduce_dtype=torch.float32 if reduce_in_fp32 else _param_dtype(model_chunks),
            pad_for_high_nccl_busbw=bool(_arg(args, "ddp_pad_buckets_for_high_nccl_busbw", False)),
            model_chunks=model_chunks)
        facade: MegatronAdamA = MegatronDistributedAdamA(optimizer, model_chunks)
    else:
        optimizer = AdamA(groups, **common, decoupled_weight_decay=True,  # Megatron's Adam is AdamW
                          clip_grad_per_tensor=_arg(args, "adama_clip_grad_per_tensor", None))
        facade = MegatronAdamA(optimizer, model_chunks)
    # Megatron's scheduler keys are set on the groups; apply wd_mult to the initial weight decay.
    for g in optimizer.param_groups:
        g["weight_decay"] = g["weight_decay"] * g.get("wd_mult", 1.0)
    return model_chunks, facade


def _param_dtype(model_chunks: list[torch.nn.Module]) -> torch.dtype:
    return next(p for chunk in model_chunks for p in chunk.parameters()).dtype
