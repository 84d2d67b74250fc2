"""What each feature says about tensor, pipeline and sequence parallelism (issue 21, item 1), before anything is
built: the layouts it cannot run are refused with the reason and the flag to change, and the ones it can are not.
The runs themselves are the Megatron-LM tier's TP 2 / PP 2 cases (megatron_adacc/testing/e2e.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_adacc.adacc.feature import problems as adacc_problems
from megatron_adacc.adacc.integration.checks import UnsupportedConfigError, check_config
from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.gact.feature import problems as gact_problems
from megatron_adacc.optim.megatron import check_supported


def _args(**flags):
    base = {"transformer_impl": "local", "recompute_granularity": None, "num_experts": None, "clip_grad": 0.0,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    return SimpleNamespace(**{**base, **flags})


def test_auto_is_refused_under_tensor_parallelism_and_presets_are_not():
    """auto's profiler times one whole layer in a process of its own: under TP it would solve for another layer."""
    refused = [p for p in adacc_problems(_args(adacc_policy="auto", tensor_model_parallel_size=2)) if "auto" in p]
    assert len(refused) == 1 and "--tensor-model-parallel-size 1" in refused[0] and "preset" in refused[0]
    for policy in ("keep", "recompute", "quantize-all"):
        assert adacc_problems(_args(adacc_policy=policy, tensor_model_parallel_size=2)) == []
    assert adacc_problems(_args(adacc_policy="auto", pipeline_model_parallel_size=2)) == []


def test_gact_under_pipeline_parallelism_needs_fixed_bits():
    """Adaptive bits probe gradients with one plain forward and backward, which a stage cannot run alone; fixed
    bits probe nothing."""
    (refused,) = gact_problems(_args(gact_level="L1", gact_adaptive=True, pipeline_model_parallel_size=2))
    assert "--no-gact-adaptive" in refused and "--pipeline-model-parallel-size 1" in refused
    assert gact_problems(_args(gact_level="L1", gact_adaptive=False, pipeline_model_parallel_size=2)) == []
    assert gact_problems(_args(gact_level="L1", gact_adaptive=True, tensor_model_parallel_size=2)) == []


def test_adama_under_pipeline_parallelism_needs_untied_embeddings():
    """Tied, the word embeddings' gradient is summed over the first and last stage after the step's last backward;
    AdamA folds each micro-batch's gradient before."""
    config = SimpleNamespace(pipeline_model_parallel_size=2, context_parallel_size=1, sequence_parallel=False,
                             num_moe_experts=None, gradient_accumulation_fusion=False, fp16=False)
    with pytest.raises(IntegrationError, match="--untie-embeddings-and-output-weights"):
        check_supported(_args(), config)
    check_supported(_args(untie_embeddings_and_output_weights=True), config)
    check_supported(_args(), SimpleNamespace(**{**vars(config), "pipeline_model_parallel_size": 1}))


def test_sequence_parallelism_is_refused_with_the_norms_reason():
    with pytest.raises(UnsupportedConfigError) as refused:
        check_config(SimpleNamespace(sequence_parallel=True, recompute_granularity=None))
    assert "torch norms" in str(refused.value) and "drop --sequence-parallel" in str(refused.value)
