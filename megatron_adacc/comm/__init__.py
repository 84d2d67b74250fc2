"""ResiReduce: compressed gradient communication with reduced error-feedback residuals (seed paper 001).

GRACE-shaped building blocks (:mod:`.base`): compressors (:mod:`.compressors`: topk, dgc, qsgd), memories
(:mod:`.memories`: plain residual and ResiReduce a / w / d / 2d / w+2d), communicators, the transports
(:mod:`.communicator`: all-gather, all-reduce; :mod:`.reduce_scatter`: the compressed reduce-scatter; chosen by
:mod:`.transport`), strung together by :class:`.pipeline.CompressedReducer`. Integrations: Megatron
DDP (:mod:`.megatron_ddp`), torch DDP communication hook (:mod:`.ddp_hook`), and `adacc train`
(:mod:`.extension`). The feature's registry entry is :mod:`.feature`.
"""

from megatron_adacc.core.lazy import exports

__all__ = [
    "Communicator",
    "CompressedReducer",
    "Compressor",
    "Memory",
    "ParamSlot",
    "ReducerOptions",
    "build_compressor",
    "build_extension",
    "build_memory",
    "build_reducer",
]
# Imported on first use (see megatron_adacc.core.lazy): the registry entry must not pull in torch.
__getattr__ = exports(__name__, {
    "Communicator": "megatron_adacc.comm.base", "Compressor": "megatron_adacc.comm.base",
    "Memory": "megatron_adacc.comm.base", "ParamSlot": "megatron_adacc.comm.base",
    "CompressedReducer": "megatron_adacc.comm.pipeline", "build_reducer": "megatron_adacc.comm.pipeline",
    "build_compressor": "megatron_adacc.comm.compressors", "build_memory": "megatron_adacc.comm.memories",
    "ReducerOptions": "megatron_adacc.comm.options", "build_extension": "megatron_adacc.comm.extension",
})
