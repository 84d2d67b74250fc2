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
    """Replaces the host's DDP wrapper and optimizer by AdamA's; with ``--use-distributed-optimizer`` its state is
    this rank's shards of the optimizer states, which both hosts checkpoint per rank."""

    name = "adama"

    def __init__(self, args: Any):
        self.args = args
        self.optimizer: Any = None

    def wrap_model(self, chunks: list, wrap: Callable[[list], list], ddp_config: Any = None) -> list:
        from megatron_adacc.optim.chunks import wrap_model_chunks

        return wrap_model_chunks(chunks, ddp_config)

    def build_optimizer(self, chunks: list, build: Callable[[list], Any]) -> Any:
        from megatron_adacc.optim.chunks import build_optimizer

        self.optimizer = build_optimizer(self.args, chunks)
        return self.optimizer

    def _shards(self) -> Any:
        inner = getattr(self.optimizer, "optimizer", None)
        return inner if hasattr(inner, "shard_state") else None

    def state_dict(self) -> dict[str, Any]:
        sharded = self._shards()
        return {"shards": sharded.shard_state()} if sharded is not None else {}

    def report(self) -> dict[str, Any]:
        inner = getattr(self.optimizer, "optimizer", None)
        if inner is None:
            return {}
        sharded = self._shards()
        report = {"distributed_optimizer": sharded is not None, "optimizer_state_bytes": inner.state_bytes()}
        if sharded is not None:
            report["gradient_bytes_held_peak"] = sharded.peak_transient_bytes
        return report

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sharded = self._shards()
        # Megatron-LM's --no-load-optim / --finetune ask for fresh optimizer states (master weights from the model).
        fresh = getattr(self.args, "no_load_optim", False) or getattr(self.args, "finetune", False)
        if sharded is not None and "shards" in state and not fresh:
            sharded.load_shard_state(state["shards"])


def build_extensions(args: Any, config: Any) -> list[TrainingExtension]:
    """The ``--adama`` extension; refuses a configuration AdamA cannot honour before the model is wrapped."""
    from megatron_adacc.optim.megatron import check_supported

    check_supported(args, config)
    return [AdamAExtension(args)]
