"""``--adama`` in either host: the model is trained without Megatron DDP's gradient buffer, under AdamA.

AdamA joins through the two optional hooks of the extension protocol: :meth:`wrap_model` puts buffer-less
stand-ins (:class:`~megatron_adacc.optim.chunks.AdamAChunk`) where the host would put Megatron's DDP, and
:meth:`build_optimizer` builds AdamA where the host would build Megatron's optimizer. Everything else of the
loop (``zero_grad_buffer``, ``no_sync``, ``finish_grad_sync``, ``optimizer.step()``) talks to those two as it
would to Megatron's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_adacc.core.extension import TrainingExtension


class AdamAExtension(TrainingExtension):
    """Replaces the host's DDP wrapper and optimizer by AdamA's."""

    name = "adama"

    def __init__(self, args: Any):
        self.args = args

    def wrap_model(self, chunks: list, wrap: Callable[[list], list], ddp_config: Any = None) -> list:
        from megatron_adacc.optim.chunks import wrap_model_chunks

        return wrap_model_chunks(chunks, ddp_config)

    def build_optimizer(self, chunks: list, build: Callable[[list], Any]) -> Any:
        from megatron_adacc.optim.chunks import build_optimizer

        return build_optimizer(self.args, chunks)


def build_extensions(args: Any, config: Any) -> list[TrainingExtension]:
    """The ``--adama`` extension; refuses a configuration AdamA cannot honour before the model is wrapped."""
    from megatron_adacc.optim.megatron import check_supported

    check_supported(args, config)
    return [AdamAExtension(args)]
