"""The three small abstractions of compressed gradient communication, in GRACE's shape.

* :class:`Compressor` turns one gradient tensor into a fixed-layout payload (a list of tensors) and adds the
  decompressed payload back into a dense tensor;
* :class:`Memory` holds the error-feedback residuals: it *compensates* a gradient before compression and is
  *updated* with the new residual after it;
* :class:`Communicator` moves the payloads of one batch of tensors between the data-parallel ranks.

A "batch" is the set of tensors reduced together: one Megatron bucket group, or one PyTorch DDP bucket.
The pipeline that strings the three together lives in :mod:`megatron_adacc.comm.pipeline`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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


class Communicator(ABC):
    """Exchanges the payloads of one batch between the ranks of a process group."""

    @abstractmethod
    def exchange(self, payloads: list[list[torch.Tensor]], group: Any, async_op: bool) -> PendingExchange:
        """Start sending ``payloads`` (one payload per tensor of the batch); returns a pending exchange."""


class PendingExchange(ABC):
    """An exchange in flight; :meth:`wait` returns, for every rank, the list of payloads it sent."""

    bytes_sent: int = 0

    @abstractmethod
    def wait(self) -> list[list[list[torch.Tensor]]]:
        """Block until done; ``result[rank][i]`` is rank ``rank``'s payload for tensor ``i``."""


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
