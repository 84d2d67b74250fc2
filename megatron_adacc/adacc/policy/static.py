"""What a GPU holds besides activations: model states, the logits workspace, and how many micro-batches a
pipeline stage keeps in flight. The rules the cost model's M_static (eq. 7) is made of, for ``auto`` and
``adacc plan`` alike; the parameter counts they apply to come from the model itself
(:mod:`megatron_adacc.adacc.integration.model_states` builds it on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes of one fp32 value: bf16 models' gradients (Megatron's DDP reduces them in an fp32 buffer,
#: ``grad_reduce_in_fp32``, both hosts' default for bf16), main parameters and Adam's two moments.
FP32 = 4
#: Bytes per value of a 16-bit type (bf16, fp16).
HALF = 2


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of one model replica's states on one GPU."""

    parameters: float
    gradients: float
    optimizer: float
    """Adam's m and v, and the fp32 main parameters when the model trains in 16 bits."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def state_bytes(dtype: str, *, distributed_optimizer: bool = False, data_parallel_size: int = 1) -> StateBytes:
    """Bytes per parameter as Megatron documents them for its (distributed) optimizer, ``d`` the data-parallel size
    (https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html):

    =========================================  ==============  ====================
    parameters, gradients                      optimizer       distributed optimizer
    =========================================  ==============  ====================
    bf16, fp32 (``grad_reduce_in_fp32``)       18              6 + 12/d
    fp16, fp16 (Megatron-LM's default)         20              4 + 16/d
    fp32, fp32                                 16              8 + 8/d
    =========================================  ==============  ====================

    The gradient buffer is whole on every rank; the distributed optimizer shards the fp32 main parameters (and, in
    fp16, the fp32 main gradients) and Adam's two moments over the ``d`` ranks. ``dtype``: the parameters', as the
    model signature names it.
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    shards = data_parallel_size if distributed_optimizer else 1
    if dtype == "bfloat16":
        return StateBytes(HALF, FP32, 3 * FP32 / shards)  # main parameters, m, v
    if dtype == "float16":
        return StateBytes(HALF, HALF, 4 * FP32 / shards)  # main parameters, main gradients, m, v
    if dtype == "float32":
        return StateBytes(FP32, FP32, 2 * FP32 / shards)  # m, v: the parameters are the main copy
    raise ValueError(f"no model-state rule for parameters in {dtype}; train in bfloat16, float16 or float32")


def logits_workspace_bytes(vocab_per_rank: int, tokens: int) -> int:
    """The policy-independent transient around the loss: the logits and their gradient in fp32, over the
    vocabulary shard this rank holds (Megatron's vocab-parallel output layer splits it over tensor-parallel
    ranks) and every token of the micro-batch."""
    return 2 * FP32 * int(vocab_per_rank) * int(tokens)


def in_flight(stage: int, pipeline_size: int, num_microbatches: int | None = None) -> int:
    """Micro-batches whose activations pipeline stage ``stage`` (0-based) of ``pipeline_size`` holds at once under
    1F1B without interleaving: its warm-up forwards plus the one in flight, ``pipeline_size - stage``, and never
    more than the step's micro-batches."""
    if not 0 <= stage < pipeline_size:
        raise ValueError(f"stage {stage} is not one of the {pipeline_size} pipeline stages")
    held = pipeline_size - stage
    return held if num_microbatches is None else max(1, min(held, num_microbatches))
