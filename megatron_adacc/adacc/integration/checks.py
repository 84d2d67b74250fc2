"""Configurations the Adacc runtime cannot run, refused up front with the flag to change.

The runtime re-implements the forward of megatron-core's *local* ``TransformerLayer`` as 14 ops and runs them
under its own saved-tensor hooks. Anything that replaces those modules (transformer-engine, MoE, MLA), wraps
them in other saved-tensor hooks (activation offloading), or changes their math in ways the re-implementation
does not follow (FP8/FP4, gated attention output, fused QKV+RoPE) is refused here rather than computed wrong.
"""

from __future__ import annotations

from typing import Any

from megatron_adacc.core.errors import AdaccError


class UnsupportedConfigError(AdaccError, ValueError):
    """The model configuration cannot run under an Adacc policy; the message names the flag to change."""


#: (config attribute, predicate "is unsupported", message). Flags are Megatron-LM's spellings.
_CONFIG_RULES: tuple[tuple[str, Any, str], ...] = (
    ("fp8", bool, "FP8 training (--fp8-format) swaps the linears for transformer-engine modules; drop --fp8-format"),
    ("fp4", bool, "FP4 training (--fp4-format) is not supported; drop --fp4-format"),
    ("fine_grained_activation_offloading", bool,
     "fine-grained activation offloading (--fine-grained-activation-offloading) installs its own saved-tensor "
     "hooks, and only the innermost hooks apply; drop --fine-grained-activation-offloading"),
    ("cpu_offloading", bool,
     "activation CPU offloading (--cpu-offloading) also uses saved-tensor hooks; drop --cpu-offloading"),
    ("num_moe_experts", lambda v: v is not None,
     "MoE layers (--num-experts) are not decomposed into Adacc ops; drop --num-experts"),
    ("multi_latent_attention", bool,
     "multi-latent attention (--multi-latent-attention) is not decomposed into Adacc ops; drop it"),
    ("attention_output_gate", bool, "gated attention output (--attention-output-gate) is not supported; drop it"),
    ("fused_single_qkv_rope", bool, "fused QKV+RoPE (--fused-single-qkv-rope) is not supported; drop it"),
    ("use_te_activation_func", bool,
     "transformer-engine activations (--use-te-activation-func) are not supported; drop it"),
    ("sequence_parallel", bool,
     "sequence parallelism (--sequence-parallel) needs norms whose weight gradients Megatron adds over the "
     "tensor-parallel ranks (each rank normalizes its own part of the sequence), which transformer-engine's and "
     "apex's norms are marked for; megatron-core's local layer spec, the one the Adacc runtime decomposes, builds "
     "torch norms, which refuse it; drop --sequence-parallel"),
    ("cuda_graph_impl", lambda v: v not in (None, "none"),
     "CUDA graphs (--cuda-graph-impl) capture the layer forward the runtime replaces; use --cuda-graph-impl none"),
    ("context_parallel_size", lambda v: (v or 1) > 1,
     "context parallelism (--context-parallel-size > 1) needs transformer-engine attention; use 1"),
)


def check_config(config: Any, *, ours: bool = False) -> None:
    """Raise :class:`UnsupportedConfigError` naming the flag when ``config`` cannot run under a policy.

    ``ours`` tells that the recompute fields were set by :func:`megatron_adacc.adacc.integration.dispatch` itself.
    """
    problems = []
    for attr, unsupported, message in _CONFIG_RULES:
        if hasattr(config, attr) and unsupported(getattr(config, attr)):
            problems.append(message)
    if not ours and getattr(config, "recompute_granularity", None) is not None:
        problems.append(
            f"Megatron's own activation recompute (--recompute-granularity {config.recompute_granularity}) "
            "cannot be combined with an Adacc policy, which decides recomputation itself; drop "
            "--recompute-granularity/--recompute-method/--recompute-num-layers (or use --adacc-policy recompute)"
        )
    if problems:
        raise UnsupportedConfigError("cannot run this model under an Adacc policy:\n  - " + "\n  - ".join(problems))


def check_layer(layer: Any) -> None:
    """Raise :class:`UnsupportedConfigError` unless ``layer`` is a local-spec dense ``TransformerLayer`` whose core
    attention is megatron's ``DotProductAttention`` or megatron-adacc's ``SDPAttention``."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_adacc.models import SDPA_SPEC_FLAG
    from megatron_adacc.models.attention import attention_kind

    hint = ("build the model with megatron-core's local layer spec (get_gpt_layer_local_spec(), "
            "--transformer-impl local)")
    if not isinstance(layer, TransformerLayer):
        raise UnsupportedConfigError(f"{type(layer).__name__} is not a megatron-core TransformerLayer; {hint}")
    attn = getattr(layer, "self_attention", None)
    if type(attn).__name__ != "SelfAttention":
        raise UnsupportedConfigError(f"self_attention is {type(attn).__name__}, expected SelfAttention; {hint}")
    if attention_kind(attn.core_attention) is None:
        raise UnsupportedConfigError(
            f"core attention is {type(attn.core_attention).__name__}; the Adacc ops decompose megatron's "
            "DotProductAttention (--attention-backend local) and PyTorch's SDPA (--attention-backend flash; in "
            f"Megatron-LM {' '.join(SDPA_SPEC_FLAG)}); {hint}")
    if type(layer.mlp) is not MLP:
        raise UnsupportedConfigError(f"the MLP is {type(layer.mlp).__name__}, expected a dense MLP "
                                     f"(drop --num-experts); {hint}")
    for name in ("pre_cross_attn_layernorm", "cross_attention"):
        if not isinstance(getattr(layer, name), IdentityOp):
            raise UnsupportedConfigError(f"{name} is not an identity (cross attention is not supported)")
    if not isinstance(layer.cross_attn_bda, IdentityFuncOp):
        raise UnsupportedConfigError("cross_attn_bda is not an identity (cross attention is not supported)")
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        module = getattr(layer, name)
        if type(module).__name__.startswith("TE"):
            raise UnsupportedConfigError(f"{name} is a transformer-engine module; {hint}")
    for module in (attn.linear_qkv, attn.linear_proj, layer.mlp.linear_fc1, layer.mlp.linear_fc2):
        if type(module).__name__.startswith("TE"):
            raise UnsupportedConfigError(f"{type(module).__name__} is a transformer-engine module; {hint}")
    if getattr(layer, "offload_attn_norm", False) or getattr(layer, "offload_mlp_norm", False):
        raise UnsupportedConfigError("fine-grained activation offloading is on; drop "
                                     "--fine-grained-activation-offloading")
    check_config(layer.config, ours=True)
