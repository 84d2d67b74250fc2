"""Model components megatron-core's local layer lacks, for both hosts: a core attention computed by PyTorch's
``scaled_dot_product_attention`` (:class:`~megatron_adacc.models.attention.SDPAttention`) and the layer specs
that carry it.

This face is plain Python (the flag names and their meanings): ``adacc train``'s parser and Megatron-LM's
argument checks read it without importing torch or megatron-core. The module itself loads on first use.

Megatron-LM's ``--attention-backend`` names pick the core attention of megatron-core's *local* layer, the one
layer Adacc decomposes:

=============================  ============================================================================
``--attention-backend``        core attention
=============================  ============================================================================
``auto`` (default), ``local``  megatron-core's ``DotProductAttention``: the s x s scores, softmax and dropout
``unfused``                    are materialized (what Megatron-LM's ``--transformer-impl local`` builds for
                               every value, ``auto`` included)
``flash``, ``fused``           :class:`~megatron_adacc.models.attention.SDPAttention`: PyTorch's fused
                               kernels (flash / memory-efficient), nothing of size s x s is stored
=============================  ============================================================================

In Megatron-LM the local layer ignores ``--attention-backend``; its own ``--spec`` flag selects the SDPA layer
instead: ``--spec megatron_adacc.models.attention SDPA_LAYER_SPEC`` (:data:`SDPA_SPEC_FLAG`).
"""

from __future__ import annotations

from megatron_adacc.core.lazy import exports

#: The two core attentions the Adacc runtime decomposes (its op tables are keyed by them).
UNFUSED, SDPA = "unfused", "sdpa"

#: ``--attention-backend`` (Megatron-LM's ``AttnBackend`` names, in its order) -> the core attention.
BACKEND_KINDS: dict[str, str] = {"flash": SDPA, "fused": SDPA, "unfused": UNFUSED, "local": UNFUSED,
                                 "auto": UNFUSED}
ATTENTION_BACKENDS: tuple[str, ...] = tuple(BACKEND_KINDS)
DEFAULT_ATTENTION_BACKEND = "auto"
"""Megatron-LM's default, which builds megatron-core's ``DotProductAttention`` under the local layer."""

#: Megatron-LM's ``--spec MODULE NAME`` for the local layer with SDPA attention (a module-level ``ModuleSpec``).
SDPA_SPEC_FLAG: tuple[str, str, str] = ("--spec", "megatron_adacc.models.attention", "SDPA_LAYER_SPEC")


def backend_kind(backend: object) -> str:
    """The core attention (:data:`UNFUSED` or :data:`SDPA`) an ``--attention-backend`` value names: a name, None
    (the default) or Megatron-LM's ``AttnBackend`` member."""
    name = DEFAULT_ATTENTION_BACKEND if backend is None else getattr(backend, "name", backend)
    try:
        return BACKEND_KINDS[name]
    except KeyError:
        raise ValueError(f"--attention-backend {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}") from None


def dropout_problem(kind: str, attention_dropout: float | None, device_type: str) -> str | None:
    """Why attention dropout cannot run with core attention ``kind`` on ``device_type``, naming the flag to
    change, or None. PyTorch's CPU kernel for SDPA has no dropout: SDPA falls back to its reference math, which
    materializes the s x s probabilities and their mask, the very tensors this attention exists to avoid."""
    if kind != SDPA or not attention_dropout or device_type != "cpu":
        return None
    return (f"--attention-dropout {attention_dropout}: PyTorch's CPU attention kernel has no dropout (SDPA would "
            "materialize the s x s probabilities to apply it); use --attention-dropout 0 or --attention-backend "
            "local")


__all__ = ["ATTENTION_BACKENDS", "BACKEND_KINDS", "DEFAULT_ATTENTION_BACKEND", "SDPA", "SDPA_SPEC_FLAG", "UNFUSED",
           "SDPAttention", "attention_kind", "backend_kind", "dropout_problem", "gpt_layer_spec", "layer_spec"]
# Imported on first use (see megatron_adacc.core.lazy): the flags above must not pull in torch.
__getattr__ = exports(__name__, {name: "megatron_adacc.models.attention"
                                 for name in ("SDPAttention", "attention_kind", "gpt_layer_spec", "layer_spec")})
