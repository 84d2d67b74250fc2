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


def megatron_full_recompute_held(model, batch) -> list[int]:
    """Bytes each layer holds for backward under Megatron's own full recompute (uniform, one layer per chunk),
    measured after the forward: the unique storages its ``CheckpointFunction`` saved, less the inputs every layer
    shares (attention mask, rotary embedding, which the runtime's per-layer figures leave out too), plus the RNG
    states it keeps on its context. In forward order."""
    from megatron_adacc.adacc.runtime.checkpoint import rng_state_nbytes
    from megatron_adacc.core.saved import unique_storage_bytes

    cfg = model.config
    cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "uniform", 1
    tokens, positions, mask, labels = batch
    try:
        loss = model(tokens, positions, mask, labels=labels).float().mean()
        nodes = _checkpoint_nodes(loss.grad_fn)
        shared = {t.untyped_storage().data_ptr() for n in nodes for t in n.saved_tensors[1:]
                  if isinstance(t, torch.Tensor)}
        held = [unique_storage_bytes(t for t in n.saved_tensors if isinstance(t, torch.Tensor)
                                     and t.untyped_storage().data_ptr() not in shared)
                + rng_state_nbytes(n.rng_states) for n in nodes]
        del nodes, loss
        return held
    finally:
        cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None


def _checkpoint_nodes(root) -> list:
    """The ``CheckpointFunction`` nodes of a graph, the first layer's first."""
    found, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            found.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found[::-1]
