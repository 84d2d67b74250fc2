"""A core attention for megatron-core's local layer computed by ``torch.nn.functional.scaled_dot_product_attention``,
and the layer specs that carry it (see :mod:`megatron_adacc.models` for how each host selects it).

:class:`SDPAttention` is a drop-in for megatron-core's ``DotProductAttention`` (same constructor, same forward,
same layouts: ``[s, b, heads, head dim]`` in, ``[s, b, hidden]`` out): it is one, with the three steps that
store s x s tensors (scores, softmax, dropout) replaced by PyTorch's fused kernel, which keeps only its output
and the softmax's log-sum-exp for backward. Grouped-query attention reaches the kernel un-repeated
(``enable_gqa``); attention dropout draws under Megatron's tensor-parallel RNG tracker, as ``DotProductAttention``
does, so tensor-parallel ranks stay consistent and a recomputation under saved RNG states replays it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.models import SDPA, SDPA_SPEC_FLAG, UNFUSED, backend_kind, dropout_problem


class SDPAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by PyTorch's ``scaled_dot_product_attention``.

    The softmax scale is megatron's (``softmax_scale``, default ``1/sqrt(kv_channels)``); under
    ``apply_query_key_layer_scaling`` megatron divides the scores by the layer number and multiplies them back in
    an fp32 softmax, which the kernel's fp32 accumulation makes moot, so the kernel takes the product. With the
    causal mask type (the local GPT spec's) the kernel applies its own causal mask and the data's mask is not
    read, as transformer-engine's fused attention does: a GPT batch's mask is that causal mask.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if config.softmax_type != "vanilla":
            raise IntegrationError(f"--softmax-type {config.softmax_type}: the SDPA kernel has no softmax offset; "
                                   "use --softmax-type vanilla or --attention-backend local")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise IntegrationError("--window-size: sliding-window attention is not supported by the SDPA core "
                                   "attention; drop --window-size or use --attention-backend local")
        self.kernel_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)
        self.grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """Query ``[sq, b, np, hn]``, key and value ``[sk, b, ng, hn]`` -> context ``[sq, b, np * hn]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise IntegrationError("packed sequences and attention bias need transformer-engine attention; the "
                                   "SDPA core attention takes neither (--attention-backend local neither)")
        dropout_p = self.attention_dropout.p if self.training else 0.0
        problem = dropout_problem(SDPA, dropout_p, query.device.type)
        if problem:
            raise IntegrationError(problem)
        mask, causal = self._mask(attention_mask, attn_mask_type or self.attn_mask_type, query.size(0), key.size(0))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]: views, no copies
        forked = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else nullcontext():
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                                     scale=self.kernel_scale, enable_gqa=self.grouped)
        context = context.permute(2, 0, 1, 3).contiguous()  # [b, np, sq, hn] -> [sq, b, np, hn]
        return context.view(*context.shape[:2], self.hidden_size_per_partition)

    @staticmethod
    def _mask(attention_mask: torch.Tensor | None, mask_type: AttnMaskType, sq: int,
              sk: int) -> tuple[torch.Tensor | None, bool]:
        """(the kernel's boolean mask, True = attends; whether it is causal) for megatron's mask and its type."""
        if mask_type == AttnMaskType.causal:
            if sq == 1:  # one new token attends to every key (megatron's softmax drops the mask there too)
                return None, False
            if sq != sk:
                raise ValueError(f"a causal mask needs self attention (query length {sq}, key length {sk})")
            return None, True
        if mask_type == AttnMaskType.no_mask or attention_mask is None:
            return None, False
        return attention_mask.logical_not(), False  # megatron's True masks out, the kernel's True attends


def attention_kind(core_attention: Any) -> str | None:
    """Which core attention the Adacc runtime sees: ``SDPA``, ``UNFUSED`` (megatron-core's
    ``DotProductAttention``), or None for one it cannot decompose (transformer-engine's, MLA's ...)."""
    if isinstance(core_attention, SDPAttention):
        return SDPA
    if isinstance(core_attention, DotProductAttention):
        return UNFUSED
    return None


class LocalNorm:
    """The norm ``get_gpt_layer_local_spec`` picks, picked when the layer is built rather than with the spec:
    torch's ``RMSNorm`` / ``LayerNorm`` (``WrappedTorchNorm``), or apex's ``FusedLayerNorm`` for LayerNorm where
    apex is installed. A spec Megatron-LM imports by name (``--spec``) exists before the config that tells."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        impl = gpt_layer_specs.LNImpl if config.normalization == "LayerNorm" else WrappedTorchNorm
        return impl(config=config, hidden_size=hidden_size, eps=eps, **kwargs)


def _local_spec(core_attention: type) -> ModuleSpec:
    """megatron-core's local dense GPT layer spec with ``core_attention`` and norms chosen by the config."""
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = LocalNorm
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def gpt_layer_spec(attention_backend: Any = None) -> ModuleSpec:
    """The local GPT layer spec whose core attention ``--attention-backend`` names (a name, None for the default,
    or Megatron-LM's ``AttnBackend``; the table in :mod:`megatron_adacc.models`)."""
    if backend_kind(attention_backend) == SDPA:
        return _local_spec(SDPAttention)
    return gpt_layer_specs.get_gpt_layer_local_spec()


def layer_spec(args: Any) -> ModuleSpec:
    """The layer spec a host builds for ``args``: Megatron-LM's ``--spec MODULE NAME`` when given (its model
    builders take that spec as it is), else :func:`gpt_layer_spec` of ``--attention-backend``."""
    named = getattr(args, "spec", None)
    if named:
        return import_module(named)
    return gpt_layer_spec(getattr(args, "attention_backend", None))


SDPA_LAYER_SPEC: ModuleSpec = _local_spec(SDPAttention)
"""What Megatron-LM's ``--spec megatron_adacc.models.attention SDPA_LAYER_SPEC`` builds: the local layer with
:class:`SDPAttention` (a module-level object, which is what ``--spec`` imports)."""
assert SDPA_SPEC_FLAG[1:] == (__name__, "SDPA_LAYER_SPEC"), "SDPA_SPEC_FLAG names another object"
