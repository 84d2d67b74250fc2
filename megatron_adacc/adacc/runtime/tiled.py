"""The MLP re-run in token tiles: what bounds the floor's backward, cut by the number of tiles.

A policy that recomputes every op re-materializes a whole layer during that layer's backward, and the largest
stage is the MLP's: the outputs of ``linear_fc1`` and of the activation (the FFN width each, four times the
hidden size in a GPT MLP) and their gradients, all at once. The MLP is token-wise, so nothing forces that: a
recompute decision with ``tiles=T`` on its three ops (:data:`~megatron_adacc.adacc.policy.ops.TILED_OPS`) runs
them as one autograd node (:class:`TiledMLP`) that

* in forward runs the three ops on T slices of the tokens in turn without a graph, and saves only its input,
  ``pre_mlp_layernorm``'s output, which is stored as that op decides;
* in backward re-runs them slice by slice, each slice's forward and backward before the next's,

so what the MLP materializes at once, its FFN-wide intermediate values (and in backward their gradients), is
1/T of the untiled layer's, in the forward as in the backward: at the floor, where every layer stores little,
the last layer's forward would otherwise be the run's peak.

It is what Liger-Kernel's ``TiledMLP`` and the Mini-Sequence Transformer do; here it is a choice of the policy,
beside keeping, compressing and recomputing. The block joins no recompute segment (``policy.held_action``):
it re-runs inside its own backward, and an op output of it a later segment stores is held as it is.

Gradients: the input's slice by slice; each parameter's summed over the slices and handed to autograd once, so
its accumulation hook (Megatron DDP's, which may count a parameter only once per backward) runs once, as with
the untiled layer. That sum costs one more weight-sized gradient per MLP parameter while the block runs. Values
and gradients equal the untiled layer's up to float rounding: a slice's matrix products may take another kernel
path than the whole tensor's, and the weight gradients add the slices' partial sums in another order.

The slices cut the first (sequence) dimension of ``[s, b, h]``, so each is contiguous; under sequence
parallelism that is the local shard, which ``linear_fc1`` gathers and ``linear_fc2`` scatters slice by slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class TiledMLP(torch.autograd.Function):
    """``run(x)`` (the MLP's token-wise ops, returning ``linear_fc2``'s output) with a backward that re-runs
    it on ``tiles`` slices of ``x``'s first dimension in turn (module docstring). ``params``: the parameters
    ``run`` reads, whose gradients it returns."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], tiles: int, x: torch.Tensor,
                *params: torch.nn.Parameter) -> torch.Tensor:
        ctx.run, ctx.tiles, ctx.params = run, tiles, params
        ctx.save_for_backward(x)
        out = None
        for rows in tile_slices(x.size(0), tiles):  # a Function's forward runs without a graph
            piece = run(x[rows])
            if out is None:
                out = piece.new_empty((x.size(0), *piece.shape[1:]))
            out[rows] = piece
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        trained = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[3 + i]]
        grad_x = torch.empty_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(ctx.params)
        for rows in tile_slices(x.size(0), ctx.tiles):
            piece = x[rows].detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.run(piece)
            inputs = ([piece] if want_x else []) + [ctx.params[i] for i in trained]
            grads = torch.autograd.grad(out, inputs, grad_out[rows], allow_unused=True)
            del out  # the slice's graph goes with it, before the next slice's forward
            if want_x:
                grad_x[rows] = grads[0]
                grads = grads[1:]
            for i, g in zip(trained, grads):
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
        return (None, None, grad_x, *sums)


def tile_slices(length: int, tiles: int) -> list[slice]:
    """``tiles`` contiguous slices covering ``range(length)``, as even as whole rows allow (fewer when
    ``length < tiles``: no slice is empty)."""
    count = max(1, min(tiles, length))
    bounds = [length * k // count for k in range(count + 1)]
    return [slice(bounds[k], bounds[k + 1]) for k in range(count)]


def tiled_mlp(layer: torch.nn.Module, ln2: torch.Tensor, tiles: int,
              ops: Sequence[Callable[..., dict[str, Any]]]) -> dict[str, Any]:
    """The MLP's token-wise ops (``fc1``, ``activation``, ``fc2``: the runtime's op functions) run as one
    :class:`TiledMLP` node on ``ln2``; returns ``linear_fc2``'s outputs (``fc2_out``, and its bias Parameter,
    which megatron hands on to the bias-dropout-add)."""
    fc1, activation, fc2 = ops
    bias: dict[str, Any] = {}

    def run(x: torch.Tensor) -> torch.Tensor:
        h = fc1(layer, x)
        act = activation(layer, h["fc1_out"], h["fc1_bias"])["act"]
        del h
        out = fc2(layer, act)
        bias["fc2_bias"] = out["fc2_bias"]
        return out["fc2_out"]

    params = tuple(p for p in layer.mlp.parameters())
    fc2_out = TiledMLP.apply(run, tiles, ln2, *params)
    return {"fc2_out": fc2_out, "fc2_bias": bias["fc2_bias"]}
