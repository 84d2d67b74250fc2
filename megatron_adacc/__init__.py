"""megatron-adacc: train larger GPT models on the GPUs you have.

* Adacc — per-tensor keep / INT4-compress / recompute chosen by an MILP (:mod:`megatron_adacc.adacc`);
* ResiReduce — compressed gradient communication with reduced residuals (:mod:`megatron_adacc.comm`);
* GACT — adaptive-bit activation compression for any model (:mod:`megatron_adacc.gact`);
* AdamA — Adam accumulation that frees gradients during backward (:mod:`megatron_adacc.optim`).

The features join the two hosts (``adacc train`` and Megatron-LM's ``pretrain_gpt.py``) through one seam,
:mod:`megatron_adacc.core`; docs/ARCHITECTURE.md draws the layers.
"""

__version__ = "0.1.0"


def install(*args, **kwargs):
    """Run a megatron-core model's transformer layers under an Adacc policy:
    ``install(model, "auto", budget="30GiB", micro_batch_size=8)``; see :func:`megatron_adacc.api.install`."""
    from megatron_adacc.api import install as _install

    return _install(*args, **kwargs)


def uninstall():
    """Undo :func:`install`."""
    from megatron_adacc.api import uninstall as _uninstall

    return _uninstall()
