"""Reusable groups (ResiReduce Sect. 4.1) formed automatically from parameter names and shapes.

A parameter's *type* is its name with the layer number taken out, plus its shape and dtype:
``decoder.layers.7.mlp.linear_fc1.weight`` (4096, 1024) has type ``decoder.layers.*.mlp.linear_fc1.weight``
(4096, 1024). The layer number is the first all-digit component of the dotted name (Megatron's
``layers.N``, GPT-2's ``h.N``, a ``ModuleList``'s ``blocks.N``).

* Parameters of one type in *adjacent* layers (consecutive layer numbers) form reusable groups of at most
  ``group_size`` members: layers ``0..g-1``, ``g..2g-1``, ... of each run of consecutive layers.
* A group never spans two batches (Megatron bucket groups / DDP buckets): every member must be compensated
  with the old shared residual before the new one is written, and that is only possible when the whole
  group is reduced in one call. A type split by a batch boundary forms groups on each side.
* A type with a single parameter in the whole model (word / position embeddings, the final norm, an untied
  output layer) is a *specific layer*: it has no group to share with, so the intra-layer schemes
  (ResiReduce-d / -2d) compress its residual instead (when it has two or more dimensions).
* Anything else (a leftover chunk of one member) keeps its own full residual.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_adacc.comm.base import ParamSlot

_LAYER = re.compile(r"^(?P<prefix>(?:.*?\.)?)(?P<index>\d+)\.(?P<suffix>.+)$")


def split_layer_name(name: str) -> tuple[str, int | None]:
    """``"a.layers.3.mlp.w"`` -> ``("a.layers.*.mlp.w", 3)``; no layer number: ``(name, None)``."""
    match = _LAYER.match(name)
    if match is None:
        return name, None
    return f"{match['prefix']}*.{match['suffix']}", int(match["index"])


@dataclass(frozen=True)
class Group:
    """A reusable group: members (names, in layer order) share one residual of shape ``shape``."""

    key: str
    members: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass
class GroupPlan:
    """Where every parameter's residual lives."""

    groups: list[Group] = field(default_factory=list)
    specific: list[str] = field(default_factory=list)
    """Specific layers: the only parameter of their type."""
    alone: list[str] = field(default_factory=list)
    """Parameters of a shared type left without a partner (or all, when group_size is 1)."""

    def group_of(self) -> dict[str, Group]:
        return {m: g for g in self.groups for m in g.members}

    def describe(self) -> str:
        lines = [
            f"{len(self.groups)} reusable groups, {len(self.specific)} specific layers, "
            f"{len(self.alone)} alone"
        ]
        lines += [f"  group {g.key}: {len(g.members)} x {g.shape}" for g in self.groups]
        lines += [f"  specific {n}" for n in self.specific]
        return "\n".join(lines)


def build_groups(
    slots: Sequence[ParamSlot], group_size: int, all_slots: Sequence[ParamSlot] | None = None
) -> GroupPlan:
    """Form reusable groups of at most ``group_size`` adjacent same-type layers (see the module docstring).

    ``all_slots`` (default: ``slots``) is the whole model, used to tell specific layers from shared types when
    ``slots`` is only part of it (one PyTorch DDP bucket).
    """
    if group_size < 1:
        raise ValueError(
            f"reusable group size must be >= 1, got {group_size}; e.g. --resireduce-group-size 4"
        )
    by_type: dict[tuple, list[tuple[int | None, ParamSlot]]] = {}
    type_count: dict[tuple, int] = {}
    for slot in slots if all_slots is None else all_slots:
        kind = (split_layer_name(slot.name)[0], slot.shape, slot.dtype)
        type_count[kind] = type_count.get(kind, 0) + 1
    for slot in slots:
        pattern, index = split_layer_name(slot.name)
        kind = (pattern, slot.shape, slot.dtype)
        by_type.setdefault(kind + (slot.batch,), []).append((index, slot))

    plan = GroupPlan()
    for key, members in by_type.items():
        kind = key[:3]
        if type_count[kind] == 1:
            plan.specific.append(members[0][1].name)
            continue
        if any(index is None for index, _ in members):
            # Same name pattern without a layer number cannot repeat; defensive for duplicate names.
            plan.alone.extend(slot.name for _, slot in members)
            continue
        members.sort(key=lambda item: item[0])
        for run in _adjacent_runs(members):
            for start in range(0, len(run), group_size):
                chunk = run[start : start + group_size]
                if len(chunk) == 1:
                    plan.alone.append(chunk[0][1].name)
                    continue
                first, last = chunk[0][0], chunk[-1][0]
                gkey = key[0].replace("*", f"[{first}-{last}]", 1)
                plan.groups.append(Group(gkey, tuple(slot.name for _, slot in chunk), chunk[0][1].shape))
    return plan


def _adjacent_runs(members: list[tuple[int, ParamSlot]]) -> list[list[tuple[int, ParamSlot]]]:
    runs: list[list[tuple[int, ParamSlot]]] = []
    for item in members:
        if runs and item[0] == runs[-1][-1][0] + 1:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
