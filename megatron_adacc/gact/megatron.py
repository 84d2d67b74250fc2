"""GACT inside megatron-core models and ``adacc train``.

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
  sequences. Transformer-Engine specs already use fused attention; there is nothing to replace.
* :class:`GactExtension` / :func:`build_extension`: the ``--gact-*`` flags as a ``TrainingExtension``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable
from typing import Any

import torch

from megatron_adacc.core.extension import TrainingContext, TrainingExtension
from megatron_adacc.gact.controller import Controller
from megatron_adacc.gact.levels import Level

_MARKER = "__megatron_adacc_patched__"


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
    from megatron.core.transformer.enums import AttnMaskType

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
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, **kwargs)
    else:
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def enable_memory_efficient_attention(modules: Iterable[torch.nn.Module]) -> str:
    """Swap every local-spec ``DotProductAttention`` forward for SDPA (CB2); returns a note, or raises
    naming what prevents it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    swapped, already = 0, 0
    for m in modules:
        for sub in m.modules():
            if not isinstance(sub, DotProductAttention):
                continue
            if getattr(sub, _MARKER, False):
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
            sub.__wrapped__ = sub.forward
            sub.forward = types.MethodType(_sdpa_forward, sub)
            setattr(sub, _MARKER, True)
            swapped += 1
    if swapped + already == 0:
        return ("no local-spec DotProductAttention found (Transformer-Engine attention is already fused); "
                "CB2 adds nothing over CB1")
    return f"memory-efficient attention (SDPA flash kernel) in {swapped + already} attention modules"


class GactExtension(TrainingExtension):
    """``adacc train --gact-level ...``: compress every micro-batch's saved tensors, adapt bits."""

    name = "gact"

    def __init__(self, level: str | Level = "L1", bits: float = 4.0, adapt_interval: int = 1000,
                 group_size: int = 256, adaptive: bool = True, seed: int = 0, **controller_kwargs: Any):
        self.level = Level.parse(level)
        self.kwargs = dict(level=self.level, bits=bits, adapt_interval=adapt_interval, group_size=group_size,
                           adaptive=adaptive, seed=seed, **controller_kwargs)
        self.controller: Controller | None = None
        self._forward_backward = None
        self._pending_state: dict | None = None

    def setup(self, ctx: TrainingContext) -> None:
        self.controller = Controller(ctx.model, **self.kwargs)
        if self._pending_state:
            self.controller.load_state_dict(self._pending_state)
        self._forward_backward = ctx.forward_backward
        a = ctx.args
        if a is not None and getattr(a, "global_batch_size", None) and getattr(a, "micro_batch_size", None):
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            self.controller.microbatches_per_step = max(1, a.global_batch_size // (a.micro_batch_size * world))
        if self.level.compresses and self.controller.adaptive and ctx.forward_backward is None:
            raise RuntimeError("GACT adaptive bits need TrainingContext.forward_backward to probe gradients")

    def microbatch_context(self):
        assert self.controller is not None, "GactExtension.setup() was not called"
        return self.controller.hooks()

    def on_step_begin(self, iteration: int) -> None:
        ctl = self.controller
        ctl.iteration = iteration - 1
        ctl.maybe_adapt(self._forward_backward)

    def on_step_end(self, iteration: int, loss: float) -> None:
        self.controller.observe_gradients()
        self.controller.iteration = iteration

    def state_dict(self) -> dict:
        return self.controller.state_dict() if self.controller is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.controller is None:
            self._pending_state = state
        elif state:
            self.controller.load_state_dict(state)

    def report(self) -> dict[str, Any]:
        return self.controller.report() if self.controller is not None else {"gact_level": self.level.value}


def build_extension(args: Any) -> GactExtension:
    """Extension for ``adacc train`` arguments (``--gact-level/-bits/-adapt-interval/-group-size``).

    ``args.gact_adaptive = False`` (no flag yet; the benchmark sets it) gives fixed bits."""
    bits = float(getattr(args, "gact_bits", 4.0))
    if not math.isfinite(bits):
        raise ValueError(f"--gact-bits must be finite, got {bits}")
    return GactExtension(
        level=getattr(args, "gact_level", "L0"),
        bits=bits,
        adapt_interval=int(getattr(args, "gact_adapt_interval", 1000)),
        group_size=int(getattr(args, "gact_group_size", 256)),
        adaptive=bool(getattr(args, "gact_adaptive", True)),
        seed=int(getattr(args, "seed", 0) or 0),
    )
