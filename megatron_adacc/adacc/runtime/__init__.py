"""Adacc's execution half: run one megatron-core ``TransformerLayer`` under per-op keep / compress / recompute.

* :func:`checkpointed_layer_forward` — the policy-driven checkpoint function (:mod:`.checkpoint`);
* :mod:`.ops` — the layer forward as 14 ops (also the profiler's API for timing ops and segments);
* :mod:`.capacity` — how many channels outlier-separated INT4 stores exactly per place, learned without a sync;
* :func:`memory_report`, :func:`profile_layer_sizes`, :func:`predict_layer_memory` — bytes held for backward,
  measured by the runtime and predicted from the policy (:mod:`.memory`).

Megatron integration (patching the full-recompute entry point) lives in :mod:`megatron_adacc.adacc.integration`.
"""

from megatron_adacc.adacc.runtime.checkpoint import LayerMemory, checkpointed_layer_forward
from megatron_adacc.adacc.runtime.memory import LayerSizes, memory_report, predict_layer_memory, profile_layer_sizes
from megatron_adacc.adacc.runtime.ops import LayerOp, initial_env, layer_ops, run_ops, segment_inputs

__all__ = [
    "LayerMemory",
    "LayerOp",
    "LayerSizes",
    "checkpointed_layer_forward",
    "initial_env",
    "layer_ops",
    "memory_report",
    "predict_layer_memory",
    "profile_layer_sizes",
    "run_ops",
    "segment_inputs",
]
