"""The three small abstractions of compressed gradient communication, in GRACE's shape.

* :class:`Compressor` turns one gradient tensor into a fixed-layout payload (a list of tensors) and adds the
  decompressed payload back into a dense tensor;
* :class:`Memory` holds the error-feedback residuals: it *compensates* a gradient before compression and is
  *updated* with the new residual after it;
* :class:`Communicator` (a *transport*) moves the payloads of one batch between the data-parallel ranks and
  leaves the sum of every rank's decompressed payload in the gradients.

A "batch" is the set of tensors reduced together: one Megatron bucket group (one or more :class:`GradBucket`),
or one PyTorch DDP bucket.
The pipeline that strings the three together lives in :mod:`megatron_adacc.comm.pipeline`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_adacc.comm.wire import Moved, Traffic
from megatron_adacc.core.saved import unique_storage_bytes


@dataclass(frozen=True)
class PayloadSpec:
    """Dtype and element count of one payload tensor; ranks agree on the layout without exchanging it."""

    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class Compressor(ABC):
    """Compresses one gradient tensor into a payload whose layout depends only on (numel, dtype)."""

    name: str = "compressor"
    #: True when payloads of different ranks can be summed element-wise (then an all-reduce replaces the
    #: all-gather): the payload layout is position-aligned and decompression is linear.
    supports_allreduce: bool = False

    @abstractmethod
    def layout(self, numel: int, dtype: torch.dtype) -> list[PayloadSpec]:
        """The payload tensors :meth:`compress` returns for a tensor of ``numel`` elements of ``dtype``."""

    @abstractmethod
    def compress(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Compress ``tensor`` (any shape, contiguous) into tensors matching :meth:`layout`."""

    @abstractmethod
    def decompress_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor, alpha: float = 1.0) -> None:
        """``out += alpha * decompress(payload)`` in place; ``out`` has the shape of the compressed tensor."""

    def for_owner(self) -> Compressor:
        """The compressor that compresses again, on its owner, the sum of every rank's decompressed payload for a
        shard (the compressed reduce-scatter, :mod:`megatron_adacc.comm.reduce_scatter`): its payload is what
        every rank then receives, and what it drops waits in the owner's residual. This compressor by default."""
        return self

    def decompress(self, payload: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """The dense tensor a payload stands for (allocates; the pipeline uses :meth:`decompress_add`)."""
        out = torch.zeros_like(like)
        self.decompress_add(payload, out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Random-generator state of stochastic compressors, so that a resumed run repeats exactly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        """Restore :meth:`state_dict`."""


class Memory(ABC):
    """Error-feedback residual storage.

    Per batch the pipeline calls, for every tensor ``g`` of the batch: ``compensate(g, name)`` (in place,
    ``g += stored residual``), compresses ``g``, turns ``g`` into the new residual ``r = g - Q^-1(Q(g))``
    in place and calls ``update(r, name)``; then ``flush()`` once. ``r`` is a view that stays valid until
    :meth:`flush` returns, which is what lets the inter-layer schemes average the residuals of a group with
    no scratch buffer: every member of a group is compensated with the *old* shared residual before the
    new one is written.
    """

    name: str = "memory"

    @abstractmethod
    def register(self, slots: Sequence[ParamSlot], all_slots: Sequence[ParamSlot] | None = None) -> None:
        """Declare tensors (name, shape, dtype, batch) and allocate their residual storage.

        ``all_slots`` is the whole model when ``slots`` is only part of it (used to find specific layers)."""

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> None:
        """Add the stored residual of ``name`` to ``tensor`` in place."""

    @abstractmethod
    def update(self, residual: torch.Tensor, name: str) -> None:
        """Record the new residual of ``name``; ``residual`` is valid until :meth:`flush` returns."""

    def flush(self) -> None:  # noqa: B027 - only group-sharing memories need it
        """Called once after every :meth:`update` of a batch."""

    @abstractmethod
    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this memory holds, by a stable key (used for checkpoints and for measuring)."""

    @abstractmethod
    def formula_bytes(self) -> int:
        """Residual bytes predicted from the shapes alone (the scheme's memory formula)."""

    def residual_bytes(self) -> int:
        """Residual bytes actually held: the sum of the distinct storages of :meth:`stored_tensors`."""
        return unique_storage_bytes(self.stored_tensors().values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: t.detach().clone() for key, t in self.stored_tensors().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = self.stored_tensors()
        missing = sorted(set(mine) - set(state))
        unexpected = sorted(set(state) - set(mine))
        if missing or unexpected:
            raise ValueError(
                f"{type(self).__name__}: residual checkpoint does not match this model/scheme "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}); resume with the same --resireduce, "
                f"group size, ratio and data-parallel layout it was saved with"
            )
        for key, t in mine.items():
            src = state[key]
            if src.shape != t.shape or src.dtype != t.dtype:
                raise ValueError(
                    f"{type(self).__name__}: residual {key!r} has shape {tuple(src.shape)} {src.dtype} in "
                    f"the checkpoint but {tuple(t.shape)} {t.dtype} here"
                )
            t.copy_(src)


@dataclass(frozen=True)
class GradBucket:
    """One flat gradient buffer reduced as a unit (a Megatron bucket's ``grad_data``, a torch DDP bucket) and where
    each named parameter's gradient lies in it: ``params`` are ``(name, start, shape)``. The reduce-scatter transport
    shards ``data`` across the ranks as Megatron's reduce-scatter does; ranges no parameter covers (Megatron's
    padding) are never compressed."""

    data: torch.Tensor
    params: tuple[tuple[str, int, tuple[int, ...]], ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> GradBucket:
        """A bucket of one tensor (a gradient that lies in no larger buffer)."""
        return cls(tensor.view(-1), ((name, 0, tuple(tensor.shape)),))

    def named_views(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter's gradient, shaped as the parameter (views of :attr:`data`)."""
        out = []
        for name, start, shape in self.params:
            numel = math.prod(shape)
            out.append((name, self.data[start : start + numel].view(shape)))
        return out

    def ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every parameter in :attr:`data`."""
        return [(start, start + math.prod(shape)) for _, start, shape in self.params]


@dataclass(frozen=True)
class Piece:
    """The range ``[start, stop)`` of bucket ``bucket`` that the compressor compresses as one tensor; ``owner`` is
    the rank that reduces it (reduce-scatter), ``None`` when every rank does (all-gather, all-reduce)."""

    bucket: int
    start: int
    stop: int
    owner: int | None = None


@dataclass(frozen=True)
class Plan:
    """How one batch travels: its pieces in compression order, each piece's payload layout, and the ranks."""

    pieces: tuple[Piece, ...]
    specs: tuple[tuple[PayloadSpec, ...], ...]
    world: int
    rank: int
    shard_only: bool = False
    """Only the rank's own shard of each bucket has to hold the result (Megatron's distributed optimizer)."""
    key: str = "0"
    """The batch's name, the same in every run of the same model: it keys a transport's state in checkpoints."""
    owner_specs: tuple[tuple[PayloadSpec, ...], ...] | None = None
    """Each piece's payload layout once its owner has compressed the sum again (:meth:`Compressor.for_owner`),
    for a transport that does."""


class Communicator(ABC):
    """Reduces one batch of compressed gradients between the ranks of a process group (a *transport*)."""

    name: str = "communicator"
    #: Whether the owner of a piece compresses the ranks' sum again before every rank receives it.
    recompresses: bool = False

    def split(self, buckets: Sequence[GradBucket], world: int, shard_only: bool) -> list[Piece]:
        """The pieces the compressor compresses one by one: every parameter whole (layer-wise compression)."""
        return [Piece(b, start, stop) for b, bucket in enumerate(buckets) for start, stop in bucket.ranges()]

    @abstractmethod
    def traffic(self, plan: Plan) -> list[Moved]:
        """The byte model: per rank, what one reduction of ``plan`` sends and receives, from the layouts alone."""

    @abstractmethod
    def start(self, plan: Plan, buckets: Sequence[GradBucket], payloads: list[list[torch.Tensor]],
              compressor: Compressor, group: Any, async_op: bool, traffic: Traffic) -> PendingExchange:
        """Start moving ``payloads`` (one per piece of ``plan``); the pending exchange's ``wait`` writes the reduced
        gradient into the buckets (the own shards only, for ``shard_only``): the sum over ranks of every piece's
        decompressed payload, compressed once more on its owner by the reduce-scatter."""

    def state_dict(self) -> dict[str, Any]:
        """State a resumed run needs (the reduce-scatter owners' residuals)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        """Restore :meth:`state_dict`."""

    def residual_bytes(self) -> int:
        """Bytes of error-feedback residual this transport holds beside the memory's."""
        return 0


class PendingExchange(ABC):
    """An exchange in flight; :meth:`wait` completes it and writes the reduced gradients in place."""

    outputs: list[torch.Tensor]
    """The views that hold the reduced sums once :meth:`wait` returns."""
    work: Any = None
    """The one collective still in flight when completing it is all :meth:`wait` waits for (a torch DDP hook
    chains on its future); ``None`` when nothing or more than one collective is left."""

    @abstractmethod
    def wait(self) -> None:
        """Block until done; idempotent."""


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the reduction: its name, shape and the batch it is reduced in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    batch: int
    device: torch.device = torch.device("cpu")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n
