"""`adacc train`: megatron-core GPT training on the embedded corpus, with every feature behind a flag."""

from megatron_adacc.core.extension import TrainingContext, TrainingExtension

__all__ = ["TrainingContext", "TrainingExtension"]
