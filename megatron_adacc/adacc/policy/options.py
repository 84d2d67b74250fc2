"""How a solve is asked for: the options a run's flags set, apart from the solver that reads them.

Its own module because the training process holds these options all run long (evolution re-solves with them)
while the solver itself, its cost model and the MILP backend run in a forked child on the CPU, where the
budget is the training process's peak RSS (:func:`~megatron_adacc.adacc.integration.planning.isolated_solves`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: The least headroom of a run that names no ``--adacc-memory-headroom``. On tiny (440 MiB, cold profile
#: cache, evolution on, 100 steps) the peak exceeded the prediction by up to 5.5 MiB, 1.3%: heap and code pages
#: that a compressing policy and evolution's switches touch and the keep-everything calibration does not
#: (benchmarks/README.md). Budgets from 800 MiB up keep 1% or more, so only small CPU budgets see the floor.
HEADROOM_FLOOR_BYTES = 8 * 2**20


@dataclass
class SolveOptions:
    chain_aware: bool = True
    heterogeneous: bool = True
    codecs: str = "default"
    """``default``: the paper's layer-specific codec per op; ``all``: every applicable codec measured."""
    codec_family: str = "int4"
    """``int4`` (the paper's codecs), ``gact`` (GACT's stochastic quantizer for every compressed tensor) or
    ``none`` (no compression: each tensor is kept or recomputed, so training math is exactly stock Megatron's)."""
    outlier_z: float = 3.0
    outlier_separation: bool = True
    """False: tensors whose paper codec is outlier-separated INT4 get plain per-token INT4 instead (the
    paper's "Adacc w/o outlier" ablation)."""
    process_baseline_bytes: float = 0.0
    """Memory the process holds besides the model (on the CPU: the interpreter, torch and megatron-core, whose
    pages count in peak RSS, the CPU's measure of the budget). Added to the static memory of eq. 7."""
    codec_pages_bytes: float = 0.0
    """What a policy that compresses anything adds to :attr:`process_baseline_bytes` (on the CPU: the pages of the
    codecs' kernels and the buffers they keep, which a keep-everything run never touches; measured once per profile
    by ``auto``'s calibration, set on the run's arguments as ``adacc_codec_pages_bytes``). The solver charges it
    only to policies that compress: it weighs the best of those against the best of those that do not."""
    headroom: float = 0.01
    """Fraction of the budget the solver leaves free for what the cost model does not see (allocator
    fragmentation, run-to-run variation of the peak). Measured peaks on the CPU came within 0.6% of the
    model's prediction (benchmarks/README.md), hence 1%."""
    headroom_min_bytes: float = 0.0
    """Bytes the solver leaves free at least, whatever the fraction: what the cost model does not see is partly
    a fixed amount (heap and code pages that a compressing policy, its evolution's probes and switches touch),
    which 1% of a small budget does not cover. :meth:`from_args` sets :data:`HEADROOM_FLOOR_BYTES` when the run
    names no ``--adacc-memory-headroom``; a named fraction is taken as it is."""
    mlp_tiles: int = 8
    """Besides the policies that re-run the MLP whole, the solver weighs those that re-run it in this many token
    tiles (:func:`~.cost_model.tile_mlp`) and takes them where they are faster or the only ones that fit. 1: no
    tiling (every gradient then equals stock Megatron's bit for bit under a lossless policy; tiling sums the MLP's
    weight gradients over the tiles, equal up to float rounding)."""

    def usable_bytes(self, budget_bytes: float) -> float:
        """What a policy may fill of ``budget_bytes``: the budget less the headroom."""
        return budget_bytes - max(budget_bytes * self.headroom, self.headroom_min_bytes)

    def needed_budget(self, usable: float) -> int:
        """The smallest budget whose :meth:`usable_bytes` is ``usable``."""
        return int(math.ceil(max(usable / (1.0 - self.headroom), usable + self.headroom_min_bytes)))

    def headroom_text(self) -> str:
        floor = f", at least {self.headroom_min_bytes / 2**20:g} MiB" if self.headroom_min_bytes else ""
        return f"{self.headroom:.0%} headroom{floor}"

    @classmethod
    def from_args(cls, args: Any) -> SolveOptions:
        headroom = getattr(args, "adacc_memory_headroom", None)
        return cls(chain_aware=getattr(args, "adacc_chain_aware", True),
                   heterogeneous=getattr(args, "adacc_heterogeneous", True),
                   codecs=getattr(args, "adacc_codecs", "default") or "default",
                   codec_family=getattr(args, "adacc_codec", "int4") or "int4",
                   outlier_z=getattr(args, "adacc_outlier_z", 3.0) or 3.0,
                   outlier_separation=not getattr(args, "adacc_no_outlier_separation", False),
                   process_baseline_bytes=float(getattr(args, "adacc_process_baseline_bytes", 0.0) or 0.0),
                   codec_pages_bytes=float(getattr(args, "adacc_codec_pages_bytes", 0.0) or 0.0),
                   headroom=0.01 if headroom is None else float(headroom),
                   headroom_min_bytes=HEADROOM_FLOOR_BYTES if headroom is None else 0.0,
                   mlp_tiles=int(getattr(args, "adacc_mlp_tiles", 8) or 1))
