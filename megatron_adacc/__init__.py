"""megatron-adacc: train larger GPT models on the GPUs you have.

* Adacc — per-tensor keep / INT4-compress / recompute chosen by an MILP (:mod:`megatron_adacc.policy`,
  executed by :mod:`megatron_adacc.runtime`, wired into Megatron by :mod:`megatron_adacc.megatron`);
* ResiReduce — compressed gradient communication with reduced residuals (:mod:`megatron_adacc.comm`);
* GACT — adaptive-bit activation compression for any model (:mod:`megatron_adacc.gact`);
* AdamA — Adam accumulation that frees gradients during backward (:mod:`megatron_adacc.optim`).
"""

__version__ = "0.1.0"


def install(*args, **kwargs):
    """Route megatron-core's transformer layers through an Adacc policy; see :func:`megatron_adacc.megatron.install`."""
    from .megatron import install as _install

    return _install(*args, **kwargs)


def uninstall():
    """Undo :func:`install`."""
    from .megatron import uninstall as _uninstall

    return _uninstall()
