"""Machinery shared by the ResiReduce memories: reusable groups (inter-layer), specific layers (intra).

The individual schemes live one per file (``resireduce_a``, ``_w``, ``_d``, ``_2d``, ``_w2d``); each is this
class with an inter-layer weighting, an intra-layer scheme, or both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from megatron_adacc.comm.base import Memory, ParamSlot
from megatron_adacc.comm.groups import Group, GroupPlan, build_groups
from megatron_adacc.comm.memories.residual import dtype_bytes

#: ``weights(residuals) -> [w_1, ..., w_alpha]`` for the members of one reusable group: numbers, or 0-d tensors
#: on the residuals' device (weights computed from the residuals stay there: nothing is read on the host).
Weighting = Callable[[Sequence[torch.Tensor]], list[float] | list[torch.Tensor]]

INDEX_DTYPE = torch.int64


class IntraLayerScheme(ABC):
    """Stores part of a specific layer's 2-D residual (rows x columns view of the parameter)."""

    name = "intra"

    @abstractmethod
    def allocate(
        self, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Zero storage for a ``rows x cols`` residual (compensating with it is a no-op)."""

    @abstractmethod
    def compensate(self, tensor2d: torch.Tensor, store: dict[str, torch.Tensor]) -> None:
        """Add the stored part of the residual to ``tensor2d`` in place."""

    @abstractmethod
    def update(self, residual2d: torch.Tensor, store: dict[str, torch.Tensor]) -> None:
        """Keep the selected part of ``residual2d`` in ``store`` (in place)."""

    @abstractmethod
    def formula_bytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        """Bytes :meth:`allocate` holds for a ``rows x cols`` residual."""


def _weighted_mean(out: torch.Tensor, residuals: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    """``out = sum_i w_i r_i / sum_i w_i`` with device weights (``out`` zeroed; it stays zero when every weight is,
    which only all-zero residuals give)."""
    total = torch.stack(list(weights)).sum()
    for w, r in zip(weights, residuals):
        out.addcmul_(r, w.to(out.dtype))  # w is 0-d: no residual-sized temporary
    out.div_(torch.where(total > 0, total, 1.0).to(out.dtype))


def check_ratio(ratio: float) -> float:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ResiReduce ratio must be in (0, 1], got {ratio}; e.g. --resireduce-ratio 0.5")
    return float(ratio)


def kept(count: int, ratio: float) -> int:
    """Rows (or columns) kept out of ``count``: ``max(1, floor(ratio * count))`` (the authors' rounding)."""
    return max(1, min(count, int(ratio * count)))


def as_2d(tensor: torch.Tensor) -> torch.Tensor:
    """The rows x columns view of a parameter: dimension 0 by the product of the others."""
    return tensor.view(tensor.shape[0], -1)


class ResiReduceMemory(Memory):
    """Residuals reused across reusable groups and/or compressed inside specific layers.

    * Parameters in a reusable group ``j`` (``alpha_j`` members, see :mod:`megatron_adacc.comm.groups`) are
      all compensated with one shared residual ``S_j``; after the batch, ``S_j = sum_i w_i r_i / sum_i w_i``
      over the members' new residuals ``r_i`` (``w_i`` from the weighting; zero when all ``r_i`` are zero).
    * Specific layers with two or more dimensions keep what ``intra`` selects of their residual.
    * Everything else keeps a full residual, as in plain error feedback.

    Memory formula, ``e`` bytes per gradient element:
    ``e * (sum_groups n_j + sum_full n_i) + sum_specific intra.formula_bytes``.
    """

    name = "resireduce"

    def __init__(
        self, group_size: int = 4, weighting: Weighting | None = None, intra: IntraLayerScheme | None = None
    ):
        self.group_size = group_size if weighting is not None else 1
        self.weighting = weighting
        self.intra = intra
        self.plan = GroupPlan()
        self.full: dict[str, torch.Tensor] = {}
        self.shared: dict[str, torch.Tensor] = {}
        self.group_of: dict[str, Group] = {}
        self.intra_store: dict[str, dict[str, torch.Tensor]] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._formula = 0

    def register(self, slots: Sequence[ParamSlot], all_slots: Sequence[ParamSlot] | None = None) -> None:
        plan = build_groups(slots, self.group_size, all_slots)
        by_name = {s.name: s for s in slots}
        for group in plan.groups:
            slot = by_name[group.members[0]]
            self.shared[group.key] = torch.zeros(group.shape, dtype=slot.dtype, device=slot.device)
            self._formula += slot.numel * dtype_bytes(slot.dtype)
            for member in group.members:
                self.group_of[member] = group
        for name in plan.specific:
            slot = by_name[name]
            if self.intra is not None and len(slot.shape) >= 2:
                rows, cols = slot.shape[0], slot.numel // slot.shape[0]
                self.intra_store[name] = self.intra.allocate(rows, cols, slot.dtype, slot.device)
                self._formula += self.intra.formula_bytes(rows, cols, slot.dtype)
            else:
                self._allocate_full(slot)
        for name in plan.alone:
            self._allocate_full(by_name[name])
        self.plan.groups += plan.groups
        self.plan.specific += plan.specific
        self.plan.alone += plan.alone

    def compensate(self, tensor: torch.Tensor, name: str) -> None:
        group = self.group_of.get(name)
        if group is not None:
            tensor.add_(self.shared[group.key])
        elif name in self.intra_store:
            self.intra.compensate(as_2d(tensor), self.intra_store[name])
        else:
            tensor.add_(self.full[name])

    def update(self, residual: torch.Tensor, name: str) -> None:
        group = self.group_of.get(name)
        if group is not None:
            self._pending.setdefault(group.key, {})[name] = residual
        elif name in self.intra_store:
            self.intra.update(as_2d(residual), self.intra_store[name])
        else:
            self.full[name].copy_(residual)

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for key, residuals in pending.items():
            group = next(self.group_of[m] for m in residuals)
            if len(residuals) != len(group.members):
                missing = sorted(set(group.members) - set(residuals))
                raise RuntimeError(
                    f"reusable group {key} was reduced in parts (missing {missing}); groups must lie in one "
                    f"batch (Megatron bucket group / DDP bucket)"
                )
            ordered = [residuals[m] for m in group.members]
            weights = self.weighting(ordered)
            shared = self.shared[key]
            shared.zero_()
            if all(isinstance(w, torch.Tensor) for w in weights):
                _weighted_mean(shared, ordered, weights)
                continue
            total = sum(weights)
            if total == 0.0:
                continue
            for w, r in zip(weights, ordered):
                shared.add_(r, alpha=w)
            shared.div_(total)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"param:{n}": t for n, t in self.full.items()}
        out.update({f"group:{k}": t for k, t in self.shared.items()})
        for name, store in self.intra_store.items():
            out.update({f"intra:{name}.{part}": t for part, t in store.items()})
        return out

    def formula_bytes(self) -> int:
        return self._formula

    def _allocate_full(self, slot: ParamSlot) -> None:
        self.full[slot.name] = torch.zeros(slot.shape, dtype=slot.dtype, device=slot.device)
        self._formula += slot.numel * dtype_bytes(slot.dtype)
