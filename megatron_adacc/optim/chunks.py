"""AdamA in a Megatron training loop (``adacc train --adama`` and ``pretrain_gpt.py --adama``).

AdamA saves memory only if Megatron's ``DistributedDataParallel`` never allocates its persistent gradient
buffer, and :func:`megatron_adacc.optim.megatron.setup_adama` refuses DDP-wrapped chunks for that reason. But
Megatron-LM's loop talks to the DDP wrapper (``zero_grad_buffer``, ``finish_grad_sync``, ``no_sync``,
``ddp_config``, ``unwrap_model``), so the wrapper cannot simply be left out. :class:`AdamAChunk` stands in its
place: it *is* a ``DistributedDataParallel`` for ``isinstance`` (so ``unwrap_model`` and checkpointing see
through it) but skips DDP's constructor, hence owns no buffer and registers no gradient hooks; its
gradient-sync methods do nothing because AdamA folds every gradient into ``m`` and ``v`` during backward, and
reduces what it must itself (the moments once per step, or with ``--use-distributed-optimizer`` each bucket of
gradients as backward completes it, and the parameters after the step).

This module imports megatron-core and is only imported when ``--adama`` is on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import MegatronModule

from megatron_adacc.optim.megatron import setup_adama


class AdamAChunk(DistributedDataParallel):
    """A model chunk in DDP's place without DDP's gradient buffer (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, ddp_config: Any, config: Any) -> None:
        MegatronModule.__init__(self, config=config)  # not DDP.__init__: that allocates the gradient buffer
        self.module = module
        # Megatron-LM's loop reads flags of the DDP config; a host without one gets DDP's defaults.
        self.ddp_config = ddp_config if ddp_config is not None else DistributedDataParallelConfig()
        self.force_all_reduce = False
        self.bucket_groups: list = []
        self.expert_parallel_bucket_groups: list = []
        # DDP's lists of gradient buffers (shadowing Module.buffers(), as DDP does): Megatron-LM walks them at
        # exit to release NCCL memory pools.
        self.buffers: list = []
        self.expert_parallel_buffers: list = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def zero_grad_buffer(self) -> None:
        """No buffer: AdamA's ``zero_grad`` starts the mini-batch."""

    def start_grad_sync(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to reduce: AdamA all-reduces its moments in ``step``."""

    def finish_grad_sync(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to reduce: AdamA all-reduces its moments in ``step``."""

    def start_param_sync(self, *args: Any, **kwargs: Any) -> None:
        """AdamA's step leaves the parameters complete on every rank (it all-gathers them when sharded)."""

    def enable_forward_pre_hook(self) -> None:
        """No parameter all-gather to overlap."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """No parameter all-gather to overlap."""

    def broadcast_params(self) -> None:
        """``setup_adama`` broadcasts the parameters from the first data-parallel rank itself."""

    def scale_gradients(self, scaling_factor: float) -> None:
        raise RuntimeError(
            "--adama folds each micro-batch gradient into Adam's moments as it is produced, so gradients cannot "
            "be rescaled afterwards; drop --calculate-per-token-loss"
        )


def wrap_model_chunks(model_chunks: list[torch.nn.Module], ddp_config: Any = None) -> list[AdamAChunk]:
    """What the hosts train under ``--adama`` instead of Megatron's DDP wrappers."""
    return [AdamAChunk(chunk, ddp_config, chunk.config) for chunk in model_chunks]


class MegatronLMAdamA:
    """AdamA's Megatron-shaped optimizer plus the few attributes Megatron-LM's loop reads on top."""

    is_stub_optimizer = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def prepare_model_params_for_param_sync(self) -> None:
        """AdamA's step leaves the parameters complete on every rank; nothing to prepare."""

    # -- Megatron-LM calls these with --use-distributed-optimizer (--ckpt-format torch). AdamA's shards travel as
    # its extension's state instead (megatron_adacc/rankNNNNN.pt beside the checkpoint, one file per rank).
    def save_parameter_state(self, filename: str) -> None:
        """Nothing to write here: each rank's AdamA shards are the AdamA extension's checkpoint state."""

    def load_parameter_state(self, filename: str, **kwargs: Any) -> None:
        """Nothing to read here: each rank's AdamA shards are the AdamA extension's checkpoint state."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def build_optimizer(args: Any, model_chunks: list[torch.nn.Module]) -> MegatronLMAdamA:
    """AdamA for the chunks Megatron built (``AdamAChunk`` wrappers), in ``get_megatron_optimizer``'s place."""
    bare = []
    for chunk in model_chunks:
        if not isinstance(chunk, AdamAChunk):
            raise TypeError(
                f"--adama expected the model chunks megatron-adacc wrapped (AdamAChunk), got {type(chunk).__name__}; "
                "Megatron-LM built the model through a path megatron-adacc does not hook (see docs/megatron-lm.md)"
            )
        bare.append(chunk.module)
    config = getattr(bare[0], "config", None)
    # Megatron's schedules divide every micro-batch loss by the number of micro-batches.
    _, optimizer = setup_adama(args, bare, config, loss_divided_by_num_microbatches=True)
    return MegatronLMAdamA(optimizer)
