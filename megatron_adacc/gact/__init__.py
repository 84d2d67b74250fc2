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

Megatron: ``adacc train --gact-level L1`` (:mod:`.extension`; the registry entry is :mod:`.feature`).
"""

from megatron_adacc.core.lazy import exports

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
# Imported on first use (see megatron_adacc.core.lazy): the registry entry must not pull in torch.
__getattr__ = exports(__name__, {
    **dict.fromkeys(("BIT_LEVELS", "allocate_bits", "predicted_variance", "variance_factor"),
                    "megatron_adacc.gact.allocation"),
    "Controller": "megatron_adacc.gact.controller", "GactVarianceWarning": "megatron_adacc.gact.monitor",
    "Level": "megatron_adacc.gact.levels", "build_extension": "megatron_adacc.gact.extension",
})
