"""A parallel layout (TP, PP, DP, SP, the distributed optimizer), what it asks of the model, and the process groups
that let this one process build a tensor-parallel shard of any size without the other ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from megatron_adacc.core.errors import AdaccError


class LayoutError(AdaccError, ValueError):
    """A parallel layout the model cannot be split into (the message names the flag to change)."""


@dataclass(frozen=True)
class Layout:
    """How the model is split over GPUs."""

    tensor: int = 1
    """Tensor-parallel size (``--tensor-model-parallel-size``)."""
    pipeline: int = 1
    """Pipeline-parallel size (``--pipeline-model-parallel-size``), 1F1B without interleaving."""
    data: int = 1
    """Data-parallel size: the GPUs are ``tensor x pipeline x data``."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism over the tensor-parallel ranks (``--sequence-parallel``)."""
    distributed_optimizer: bool = False
    """Optimizer states sharded over the data-parallel ranks (``--use-distributed-optimizer``)."""

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    def describe(self) -> str:
        parts = [f"TP {self.tensor}", f"PP {self.pipeline}", f"DP {self.data}"]
        if self.sequence_parallel:
            parts.append("SP")
        if self.distributed_optimizer:
            parts.append("distributed optimizer")
        return ", ".join(parts) + f" ({self.gpus} GPUs)"

    @classmethod
    def from_args(cls, args: Any) -> Layout:
        return cls(tensor=int(getattr(args, "tensor_model_parallel_size", None) or 1),
                   pipeline=int(getattr(args, "pipeline_model_parallel_size", None) or 1),
                   data=int(getattr(args, "data_parallel_size", None) or 1),
                   sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                   distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))

    def problems(self, config: Any, seq_length: int) -> list[str]:
        """What keeps ``config`` from splitting this way, each with the flag to change (Megatron's own checks,
        asked before anything is built)."""
        tp, found = self.tensor, []
        heads = config.num_attention_heads
        groups = config.num_query_groups or heads
        for flag, value in (("--num-attention-heads", heads), ("--num-query-groups", groups),
                            ("--ffn-hidden-size", config.ffn_hidden_size)):
            if value % tp:
                found.append(f"--tensor-model-parallel-size {tp} does not divide {flag} {value} (each tensor-"
                             f"parallel rank holds an equal share); use a TP size that divides it")
        if config.num_layers % self.pipeline:
            found.append(f"--pipeline-model-parallel-size {self.pipeline} does not divide --num-layers "
                         f"{config.num_layers} (stages of equal layers); use a PP size that divides it")
        if self.sequence_parallel and tp == 1:
            found.append("--sequence-parallel splits the sequence over tensor-parallel ranks: it needs "
                         "--tensor-model-parallel-size > 1")
        if self.sequence_parallel and seq_length % tp:
            found.append(f"--sequence-parallel: --seq-length {seq_length} is not a multiple of "
                         f"--tensor-model-parallel-size {tp}")
        return found

    def check(self, config: Any, seq_length: int) -> None:
        found = self.problems(config, seq_length)
        if found:
            raise LayoutError("; ".join(found))

    def shard(self, config: Any) -> Any:
        """``config`` as one rank of this layout builds its model."""
        out = copy.copy(config)
        out.tensor_model_parallel_size = self.tensor
        out.pipeline_model_parallel_size = self.pipeline
        out.sequence_parallel = self.sequence_parallel
        if self.pipeline > 1 and getattr(out, "pipeline_dtype", None) is None:
            out.pipeline_dtype = out.params_dtype
        return out


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor: int) -> int:
    """Megatron-LM's padding of the tokenizer's vocabulary (``_vocab_size_with_padding``): up to a multiple of
    ``--make-vocab-size-divisible-by`` times the tensor-parallel size, so every rank holds whole rows."""
    multiple = divisible_by * tensor
    return -(-vocab_size // multiple) * multiple


class _Done:
    """The completed work of a collective that had nothing to move."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True


class FakeGroup:
    """A process group in which this process is rank 0 of ``size`` and whose collectives move nothing: what
    megatron-core needs to build a tensor-parallel shard of any size, and to run it on fake tensors (sizes only),
    where every output a collective fills is allocated beforehand. Not registered with torch.distributed, so the
    process's own groups (a world of one, a training run's) are left as they are."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0

    def _nothing(self, *args: Any, **kwargs: Any) -> _Done:
        return _Done()

    # what torch.distributed's collectives call on their group
    allreduce = all_gather_single = _allgather_base = allgather = reduce_scatter_single = _nothing
    _reduce_scatter_base = reduce_scatter = broadcast = barrier = _nothing


def fake_groups(layout: Layout) -> Any:
    """A megatron ``ProcessGroupCollection`` of :class:`FakeGroup` s sized as ``layout``'s groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp, pp, dp = layout.tensor, layout.pipeline, layout.data
    group = FakeGroup
    return ProcessGroupCollection(tp=group(tp), pp=group(pp), cp=group(1), tp_cp=group(tp), mp=group(tp * pp),
                                  embd=group(min(2, pp)), pos_embd=group(1), dp=group(dp), dp_cp=group(dp))
