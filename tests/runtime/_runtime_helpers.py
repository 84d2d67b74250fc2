"""Decision and comparison helpers for the runtime tests (imported by the test modules)."""

from __future__ import annotations

import torch

from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.adacc.policy.policy import Decision, Policy


def decisions(recompute=(), compress=None, default="keep") -> dict[str, Decision]:
    """``{op: Decision}``: ops in ``recompute`` recomputed, ``compress`` maps op -> codec, the rest ``default``."""
    compress = compress or {}
    out = {}
    for name in OP_NAMES:
        if name in recompute:
            out[name] = Decision.recompute()
        elif name in compress:
            out[name] = Decision.compress(compress[name])
        else:
            out[name] = Decision(default)
    return out


def policy_of(layers: list[dict[str, Decision]], name: str = "test") -> Policy:
    return Policy(layers=[[layer[op] for op in OP_NAMES] for layer in layers], name=name)


def grads_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose gradients differ (empty when bit-identical); fails on differing key sets."""
    assert a.keys() == b.keys() and len(a) > 10
    return [n for n in a if not torch.equal(a[n], b[n])]


def megatron_full_recompute(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of ``model`` under Megatron's own full recompute (uniform, one layer per chunk)."""
    from megatron_adacc.testing import loss_and_grads

    cfg = model.config
    cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "uniform", 1
    try:
        return loss_and_grads(model, batch)
    finally:
        cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None
