"""GACT: activation-compressed training for generic architectures, with adaptive per-tensor bit widths.

Quick start (plain PyTorch)::

    from megatron_adacc import gact

    ctl = gact.Controller(model, level="L1")       # adaptive bits, 4 on average
    for x, y in loader:
        def fwd_bwd():
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss
        loss = ctl.step(fwd_bwd)                     # probes every adapt_interval steps, then trains
        optimizer.step()
        optimizer.zero_grad()

Megatron: ``adacc train --gact-level L1`` (see :func:`build_extension`).
"""

from megatron_adacc.gact.allocation import BIT_LEVELS, allocate_bits, predicted_variance, variance_factor
from megatron_adacc.gact.controller import Controller, GactVarianceWarning
from megatron_adacc.gact.levels import Level

__all__ = [
    "BIT_LEVELS",
    "Controller",
    "GactVarianceWarning",
    "Level",
    "allocate_bits",
    "build_extension",
    "predicted_variance",
    "variance_factor",
]


def build_extension(args):
    """``TrainingExtension`` for ``adacc train`` from its parsed ``--gact-*`` arguments."""
    from megatron_adacc.gact.megatron import build_extension as _build

    return _build(args)
