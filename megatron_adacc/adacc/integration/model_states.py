"""The model's parameters per pipeline stage and what they cost on one GPU, counted from megatron-core's own
model built on the meta device: the real vocabulary, untied embeddings, every bias and norm, and the
tensor-parallel shards of this process's model-parallel groups, with no formula restating megatron's layers.

``auto`` charges these as the static memory of eq. 7 (:func:`static_memory`); ``adacc plan`` does the same for a
layout it sizes without GPUs (its tensor-parallel groups are fake ones: :mod:`megatron_adacc.adacc.planner`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from megatron_adacc.adacc.integration.sample import BYTE_VOCAB
from megatron_adacc.adacc.policy.profile import LayerProfile
from megatron_adacc.adacc.policy.signature import model_signature
from megatron_adacc.adacc.policy.static import StateBytes, in_flight, logits_workspace_bytes, state_bytes


@dataclass(frozen=True)
class ModelParameters:
    """Parameters one tensor-parallel rank holds, by part of the model."""

    embedding: int
    """Word and position embeddings (the first pipeline stage)."""
    word_embedding: int
    """The word embeddings alone: with tied embeddings under pipeline parallelism the last stage holds a copy as
    its output layer (megatron's ``LanguageModule.setup_embeddings_and_output_layer``)."""
    layer: int
    """One transformer layer."""
    head: int
    """The final norm and, with untied embeddings, the output layer (the last stage)."""
    num_layers: int
    pipeline_size: int
    tied: bool
    vocab_per_rank: int
    """Rows of the word embeddings (and of the logits) on this rank: the padded vocabulary over the tensor-parallel
    ranks (megatron's vocab-parallel embedding and output layer)."""

    def __post_init__(self) -> None:
        if self.num_layers % self.pipeline_size:
            raise ValueError(f"{self.num_layers} layers do not split into {self.pipeline_size} pipeline stages")

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pipeline_size

    def stage(self, stage: int) -> int:
        """Parameters of pipeline stage ``stage`` (0-based)."""
        first, last = stage == 0, stage == self.pipeline_size - 1
        count = self.layers_per_stage * self.layer
        count += self.embedding if first else 0
        if last:
            count += self.head + (self.word_embedding if self.tied and not first else 0)
        return count

    @property
    def total(self) -> int:
        """Parameters of the whole model on one tensor-parallel rank (a tied copy counted once)."""
        return self.embedding + self.num_layers * self.layer + self.head


def vocab_size(config: Any, args: Any) -> int:
    """The vocabulary the model's embeddings and logits span: the host's (Megatron-LM's padded one), else
    ``adacc train``'s bytes."""
    return model_signature(config, args)["vocab_size"] or BYTE_VOCAB


def one_layer_gpt(args: Any, config: Any, groups: Any = None) -> Any:
    """megatron-core's GPT with one layer and both ends of the model, as the host builds it (its layer spec,
    vocabulary, positions and embeddings), initializing nothing and leaving every random stream as it was; in
    the tensor-parallel shards of ``groups`` (a megatron ``ProcessGroupCollection``), by default of this process's
    model-parallel groups. Build it on the meta device or fake tensors: it allocates its parameters."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.models.attention import layer_spec

    one = copy.copy(config)
    one.num_layers, one.pipeline_model_parallel_size = 1, 1
    one.recompute_granularity = one.recompute_method = one.recompute_num_layers = None
    one.perform_initialization, one.use_cpu_initialization = False, True  # CPU init makes no CUDA tensor
    one.sequence_parallel = False  # it splits activations, not parameters (and local-spec norms refuse it)
    with _fork_rng():
        return GPTModel(config=one, transformer_layer_spec=layer_spec(args), vocab_size=vocab_size(config, args),
                        max_sequence_length=args.seq_length, position_embedding_type=args.position_embedding_type,
                        share_embeddings_and_output_weights=not untied(args), pg_collection=groups)


def untied(args: Any) -> bool:
    """Whether the output layer has weights of its own (``--untie-embeddings-and-output-weights``)."""
    return bool(getattr(args, "untie_embeddings_and_output_weights", False))


def count_parameters(args: Any, config: Any, groups: Any = None) -> ModelParameters:
    """The parameters of the model the host builds, by part, counted on the meta device (:func:`one_layer_gpt`)."""
    with torch.device("meta"):
        model = one_layer_gpt(args, config, groups)
    parts = {"embedding": 0, "layer": 0, "head": 0}
    for name, p in model.named_parameters():
        parts["embedding" if name.startswith("embedding.") else "layer" if name.startswith("decoder.layers.")
              else "head"] += p.numel()
    words = model.embedding.word_embeddings.weight
    return ModelParameters(embedding=parts["embedding"], word_embedding=words.numel(), layer=parts["layer"],
                           head=parts["head"], num_layers=int(config.num_layers),
                           pipeline_size=int(getattr(config, "pipeline_model_parallel_size", 1) or 1),
                           tied=not untied(args), vocab_per_rank=int(words.shape[0]))


@dataclass(frozen=True)
class StaticMemory:
    """One GPU's memory besides activations, for one pipeline stage."""

    parameters: int
    """How many parameters the stage holds (its tensor-parallel shard)."""
    per_parameter: StateBytes
    workspace_bytes: int
    """The logits workspace (:func:`~megatron_adacc.adacc.policy.static.logits_workspace_bytes`), on the last
    stage only."""

    @property
    def parameter_bytes(self) -> int:
        return int(self.parameters * self.per_parameter.parameters)

    @property
    def gradient_bytes(self) -> int:
        return int(self.parameters * self.per_parameter.gradients)

    @property
    def optimizer_bytes(self) -> int:
        return int(self.parameters * self.per_parameter.optimizer)

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer states: eq. 7's M_static."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


def data_parallel_size(args: Any) -> int:
    """The data-parallel size the distributed optimizer shards over: the host's, else the world this process is in
    divided by its model-parallel groups, else 1."""
    given = getattr(args, "data_parallel_size", None)
    if given:
        return int(given)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return 1


def static_memory(args: Any, config: Any, stage: int = 0, parameters: ModelParameters | None = None
                  ) -> StaticMemory:
    """What pipeline stage ``stage`` holds besides activations in the run ``args``/``config`` describe: model states
    under its precision and optimizer, and, on the last stage, the logits workspace at the real vocabulary split
    over the tensor-parallel ranks."""
    parameters = parameters or count_parameters(args, config)
    dtype = model_signature(config, args)["dtype"]
    per = state_bytes(dtype, distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                      data_parallel_size=data_parallel_size(args))
    last = stage == parameters.pipeline_size - 1
    tokens = args.seq_length * args.micro_batch_size
    workspace = logits_workspace_bytes(parameters.vocab_per_rank, tokens) if last else 0
    return StaticMemory(parameters.stage(stage), per, workspace)


def this_stage() -> int:
    """The pipeline stage this process runs (0 outside a pipeline)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_pipeline_model_parallel_rank()


def charge_static(profile: LayerProfile, args: Any, config: Any, stage: int | None = None,
                  parameters: ModelParameters | None = None) -> LayerProfile:
    """``profile`` with the static memory and logits workspace of the run ``args``/``config`` describe, for its
    pipeline stage ``stage`` (default: this process's): what its solve counts beside the activations.

    Charged at every use, not only when profiling: the data-parallel size and the distributed optimizer change
    the model states without changing the layer (its signature), and the profiler runs in a world of one. The
    workspace keeps one copy of the RNG states on top of the logits, as profiles always counted it. ``parameters``:
    counted already (by default, here, in this process's groups)."""
    static = static_memory(args, config, this_stage() if stage is None else stage, parameters)
    charged = copy.copy(profile)
    charged.static_bytes = static.state_bytes
    charged.workspace_bytes = static.workspace_bytes + profile.rng_bytes
    charged.meta = {**profile.meta, "static": {"parameters": static.parameters,
                                               "bytes_per_parameter": static.per_parameter.total}}
    return charged


def microbatches_per_step(args: Any) -> int | None:
    """Micro-batches each data-parallel rank runs per step (Megatron's ``get_num_microbatches()`` without batch-size
    ramp-up), None where the host names no global batch."""
    global_batch = getattr(args, "global_batch_size", None)
    if not global_batch:
        return None
    return max(1, int(global_batch) // (int(args.micro_batch_size) * data_parallel_size(args)))


def stage_layout(args: Any, config: Any) -> list[tuple[ModelParameters, int, int]]:
    """Per pipeline stage of the run: the model's parameters (counted once, in this process's groups), the stage's
    layers, and the micro-batches it holds in flight under 1F1B (:func:`~megatron_adacc.adacc.policy.static.in_flight`
    of this run's micro-batches per step)."""
    parameters = count_parameters(args, config)
    stages, per_step = parameters.pipeline_size, microbatches_per_step(args)
    return [(parameters, parameters.layers_per_stage, in_flight(stage, stages, per_step)) for stage in range(stages)]
