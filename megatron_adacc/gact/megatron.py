"""GACT's changes to megatron-core models, for levels CB1 and CB2 (:mod:`~megatron_adacc.gact.extension` decides
when to make them).

* :func:`enable_full_recompute` (CB1/CB2): switches the model's ``TransformerConfig`` to full, uniform,
  one-layer recompute. Megatron's ``CheckpointFunction`` saves each layer's inputs with
  ``save_for_backward``, so GACT's hooks compress them (the paper's "compressed segment inputs"); the
  recompute in backward runs inside the same hooks, so the layer's re-saved activations are compressed too.
* :func:`enable_memory_efficient_attention` (CB2): on the local spec, ``DotProductAttention`` materialises
  the ``[b, np, s, s]`` score and probability matrices and saves both for backward. We swap its forward
  for ``torch.nn.functional.scaled_dot_product_attention``, whose flash kernels (CPU and CUDA) save only
  q, k, v, the output and a ``[b, np, s]`` log-sum-exp: linear in the sequence length instead of quadratic.
  Refused (with the reason) where that kernel cannot hold the same semantics: attention dropout on CPU
  (torch falls back to the quadratic path), non-vanilla softmax, sliding windows, attention bias, packed
  sequences. Transformer-Engine specs already use fused attention; there is nothing to replace. The swap is
  a per-instance patch through :mod:`megatron_adacc.core.patching`, so ``unpatch(module, "forward")`` undoes it.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_adacc.core.patching import is_patched, mark, patch


def _configs(modules: Iterable[torch.nn.Module]) -> list[Any]:
    out = []
    for m in modules:
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(cfg, "recompute_granularity"):
            raise ValueError(
                f"GACT CB1/CB2 combine compression with megatron-core's full recompute, but "
                f"{type(m).__name__} has no megatron TransformerConfig. For a plain torch model use L1 and "
                f"wrap segments in torch.utils.checkpoint.checkpoint(..., use_reentrant=True): the segment "
                f"inputs it saves are then compressed by the L1 hooks.")
        if all(cfg is not c for c in out):
            out.append(cfg)
    return out


def enable_full_recompute(modules: Iterable[torch.nn.Module]) -> str:
    """Turn on full, uniform, 1-layer recompute (CB1); returns a note for the report."""
    notes = []
    for cfg in _configs(modules):
        gran = cfg.recompute_granularity
        if gran == "selective":
            raise ValueError(
                "GACT CB1/CB2 use full recompute, but the model is configured for selective recompute "
                "(--recompute-granularity selective). Drop that flag, or use --gact-level L1 with it.")
        if gran == "full":
            notes.append(f"full recompute already on ({cfg.recompute_method}, {cfg.recompute_num_layers})")
            continue
        if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
            raise ValueError("GACT CB1/CB2 do not support fp8/fp4 (TE checkpointing); use L1")
        cfg.recompute_granularity = "full"
        cfg.recompute_method = "uniform"
        cfg.recompute_num_layers = 1
        notes.append("full recompute enabled (uniform, 1 layer per checkpoint)")
    return "; ".join(notes)


def _is_causal_mask(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Megatron masks are True where attention is *forbidden*; causal means exactly the strict upper part."""
    if mask.dtype is not torch.bool or mask.shape[-2:] != (sq, sk) or sq != sk:
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return bool((mask == causal).all())


def _sdpa_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                  packed_seq_params=None):
    """Drop-in for ``DotProductAttention.forward`` (sbhd layout in, ``[sq, b, hp]`` out)."""
    if packed_seq_params is not None or attention_bias is not None:
        raise ValueError("GACT CB2 attention does not support packed sequences or attention bias")
    sq, b, np_, hn = query.shape
    sk, ng = key.shape[0], key.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
    scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
    kwargs: dict[str, Any] = {"scale": scale, "enable_gqa": ng != np_}
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    if attention_mask is None:
        kwargs["is_causal"] = mask_type == AttnMaskType.causal and sq > 1
    elif _is_causal_mask(attention_mask, sq, sk):
        kwargs["is_causal"] = True
    else:
        kwargs["attn_mask"] = ~attention_mask  # SDPA keeps True positions
    p = self.attention_dropout.p if self.training else 0.0
    if p > 0:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, **kwargs)
    else:
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def _sdpa_binder(attention: torch.nn.Module):
    """``make_wrapper`` for :func:`~megatron_adacc.core.patching.patch`: ``_sdpa_forward`` bound to ``attention``.

    A bound method, like the forward it replaces. It takes no attributes of its own, so it is marked up front
    (:func:`mark` writes through to the function) rather than letting ``patch`` copy the original's name onto
    it, which would fail."""
    return lambda original: mark(types.MethodType(_sdpa_forward, attention), original)


def enable_memory_efficient_attention(modules: Iterable[torch.nn.Module]) -> str:
    """Swap every local-spec ``DotProductAttention`` forward for SDPA (CB2); returns a note, or raises
    naming what prevents it."""
    swapped, already = 0, 0
    for m in modules:
        for sub in m.modules():
            if not isinstance(sub, DotProductAttention):
                continue
            if is_patched(vars(sub).get("forward")):  # this instance's own forward, not a class-level patch
                already += 1
                continue
            cfg = sub.config
            problems = []
            if cfg.softmax_type != "vanilla":
                problems.append(f"softmax_type={cfg.softmax_type!r}")
            if sub.scale_mask_softmax.window_size is not None:
                problems.append("sliding-window attention")
            if sub.attention_dropout.p > 0 and not torch.cuda.is_available():
                problems.append(
                    f"attention dropout {sub.attention_dropout.p} on CPU (torch's CPU flash kernel has no "
                    f"dropout and falls back to the quadratic path); set --attention-dropout 0")
            if problems:
                raise ValueError("GACT CB2 cannot use memory-efficient attention here: " + ", ".join(problems)
                                 + ". Use --gact-level CB1.")
            patch(sub, "forward", _sdpa_binder(sub), why="GACT CB2 swaps DotProductAttention.forward for SDPA")
            swapped += 1
    if swapped + already == 0:
        return ("no local-spec DotProductAttention found (Transformer-Engine attention is already fused); "
                "CB2 adds nothing over CB1")
    return f"memory-efficient attention (SDPA flash kernel) in {swapped + already} attention modules"
