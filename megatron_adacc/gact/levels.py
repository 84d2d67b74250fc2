"""GACT's optimization levels (Table 1 of the paper) and bit widths: the names its flags offer, light enough for the
feature's registry entry to import."""

from __future__ import annotations

import enum

BIT_LEVELS: tuple[int, ...] = (1, 2, 4, 8, 32)
"""The bit widths GACT chooses from; 32 means "keep the tensor uncompressed"."""

KEEP_BITS = 32


class Level(str, enum.Enum):
    """Each level adds one memory optimisation to the previous one."""

    L0 = "L0"
    """Do not compress (bit-identical to training without GACT)."""
    L1 = "L1"
    """Per-group stochastic quantization with adaptive per-tensor bits (4 bits on average)."""
    L2 = "L2"
    """L1 + swapping compressed tensors to pinned CPU memory, prefetched back on a side stream (CUDA)."""
    CB1 = "CB1"
    """L1 + Megatron full recompute, whose saved layer inputs are then compressed too."""
    CB2 = "CB2"
    """CB1 + memory-efficient self-attention (no materialised s x s score matrix)."""

    @classmethod
    def parse(cls, value: str | Level) -> Level:
        if isinstance(value, Level):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise ValueError(
                f"unknown GACT level {value!r}; choose one of {', '.join(m.value for m in cls)}"
            ) from None

    @property
    def compresses(self) -> bool:
        return self is not Level.L0

    @property
    def swaps(self) -> bool:
        return self is Level.L2

    @property
    def recomputes(self) -> bool:
        return self in (Level.CB1, Level.CB2)

    @property
    def efficient_attention(self) -> bool:
        return self is Level.CB2
