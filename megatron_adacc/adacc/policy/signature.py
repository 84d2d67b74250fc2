"""The model signature: the fields that make a profile or a policy valid for a model configuration."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from megatron_adacc.core.errors import AdaccError

#: Every field that changes the sizes or the op structure of a layer, with its JSON type (``int`` fields are
#: positive; ``vocab_size`` is null where the host does not say). A profile or a policy made for a signature
#: that differs in any of them is never reused: a GQA/SwiGLU/RMSNorm layer saves other tensors than an
#: MHA/GeLU/LayerNorm one of the same width, and a tensor-parallel shard other sizes than the whole layer.
SIGNATURE_TYPES: dict[str, type] = {
    "hidden_size": int,
    "num_attention_heads": int,
    "num_query_groups": int,
    "ffn_hidden_size": int,
    "gated_linear_unit": bool,
    "normalization": str,
    "position_embedding_type": str,
    "attention": str,
    "vocab_size": int,
    "untie_embeddings_and_output_weights": bool,
    "seq_length": int,
    "micro_batch_size": int,
    "dtype": str,
    "num_layers": int,
    "tensor_model_parallel_size": int,
    "pipeline_model_parallel_size": int,
    "sequence_parallel": bool,
    "megatron_core_version": str,
}
SIGNATURE_FIELDS: tuple[str, ...] = tuple(SIGNATURE_TYPES)
#: Fields that may be null in a signature (the host does not know them).
NULLABLE_FIELDS: frozenset[str] = frozenset({"vocab_size"})


def megatron_core_version() -> str:
    """The installed megatron-core version (``unknown`` when it cannot be imported)."""
    try:  # here, not at the top: adacc.policy itself imports no Megatron
        from megatron.core.package_info import __version__
    except Exception:  # noqa: BLE001 - an absent or broken install only weakens the signature
        return "unknown"
    return str(__version__)


def _dtype_name(config: Any, args: Any) -> str:
    if getattr(args, "bf16", False) or getattr(config, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False) or getattr(config, "fp16", False):
        return "float16"
    dtype = getattr(config, "params_dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else "float32"


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _attention(args: Any) -> str:
    """The core attention the host builds (:mod:`megatron_adacc.models`): Megatron-LM's ``--spec`` when it names
    one, else ``--attention-backend``."""
    from megatron_adacc.models import SDPA, SDPA_SPEC_FLAG, UNFUSED, backend_kind

    spec = getattr(args, "spec", None)
    if spec:
        return SDPA if tuple(spec) == SDPA_SPEC_FLAG[1:] else "spec:" + ".".join(spec)
    try:
        return backend_kind(getattr(args, "attention_backend", None))
    except ValueError:
        return UNFUSED


def args_vocab(args: Any) -> int | None:
    """The model's vocabulary as the hosts' arguments say it: Megatron-LM's padded one, else the one given (the
    Python API's, the model's own), else None (``adacc train``'s byte vocabulary without ``--vocab-size``)."""
    return getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)


def model_signature(config: Any, args: Any = None) -> dict[str, Any]:
    """The signature of a model (:data:`SIGNATURE_TYPES`): from its ``TransformerConfig`` and the run's arguments.

    Sequence length, micro-batch size, vocabulary, embeddings and attention come from ``args`` (as the hosts'
    flags name them); the rest from the config, with ``args`` as a fallback.
    """
    def get(name: str, *alts: str) -> Any:
        for src in (config, args):
            for n in (name, *alts):
                v = getattr(src, n, None) if src is not None else None
                if v is not None:
                    return v
        return None

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    vocab = args_vocab(args)
    sig = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": _first(get("num_query_groups"), heads),
        "ffn_hidden_size": _first(get("ffn_hidden_size"), 4 * hidden if hidden else None),
        "gated_linear_unit": bool(get("gated_linear_unit", "swiglu")),
        "normalization": str(get("normalization") or "LayerNorm"),
        "position_embedding_type": str(getattr(args, "position_embedding_type", None) or "learned_absolute"),
        "attention": _attention(args),
        "vocab_size": int(vocab) if vocab else None,
        "untie_embeddings_and_output_weights": bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        "seq_length": get("seq_length", "max_position_embeddings"),
        "micro_batch_size": get("micro_batch_size"),
        "dtype": _dtype_name(config, args),
        "num_layers": get("num_layers"),
        "tensor_model_parallel_size": get("tensor_model_parallel_size") or 1,
        "pipeline_model_parallel_size": get("pipeline_model_parallel_size") or 1,
        "sequence_parallel": bool(get("sequence_parallel")),
        "megatron_core_version": megatron_core_version(),
    }
    missing = [k for k, v in sig.items() if v is None and k not in NULLABLE_FIELDS]
    if missing:
        raise ValueError(f"cannot build the model signature: missing {', '.join(missing)} "
                         "(pass them in the TransformerConfig or the arguments)")
    for k, kind in SIGNATURE_TYPES.items():
        if kind is int and sig[k] is not None:
            sig[k] = int(sig[k])
    return sig


#: The values of a plain GPT layer on one device (MHA, GeLU, LayerNorm, learned positions, megatron-core's
#: unfused attention, tied embeddings) for the fields :func:`plain_signature` is not given.
_PLAIN = {"gated_linear_unit": False, "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
          "attention": "unfused", "vocab_size": None, "untie_embeddings_and_output_weights": False,
          "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "sequence_parallel": False}


def plain_signature(**fields: Any) -> dict[str, Any]:
    """A whole signature from the shape fields (hidden size, heads, FFN, sequence, micro-batch, dtype, layers,
    megatron-core version), the rest as a plain GPT layer has them; for analytic profiles and plans made without
    a model, and for tests."""
    sig = {**_PLAIN, "num_query_groups": fields.get("num_attention_heads"), **fields}
    unknown = sorted(set(sig) - set(SIGNATURE_FIELDS))
    missing = [f for f in SIGNATURE_FIELDS if f not in sig]
    if unknown or missing:
        raise ValueError(f"plain_signature: unknown fields {unknown}, missing {missing}")
    return {f: sig[f] for f in SIGNATURE_FIELDS}


def signature_key(sig: dict[str, Any], *, ignore: tuple[str, ...] = ()) -> str:
    """A stable short hash of a signature (database key)."""
    payload = {k: sig.get(k) for k in SIGNATURE_FIELDS if k not in ignore}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def signature_diff(expected: dict[str, Any], actual: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields whose values differ: ``{field: (expected, actual)}``."""
    return {k: (expected.get(k), actual.get(k)) for k in SIGNATURE_FIELDS if expected.get(k) != actual.get(k)}


class SignatureMismatchError(AdaccError, ValueError):
    """A policy or profile was made for another model."""

    def __init__(self, what: str, diff: dict[str, tuple[Any, Any]]):
        self.diff = diff
        lines = ", ".join(f"{k}: {a!r} in the {what} vs {b!r} in this run" for k, (a, b) in diff.items())
        super().__init__(f"the {what} was made for another model; differing fields: {lines}. "
                         f"Re-solve for this configuration (adacc solve, or --adacc-policy auto).")


def check_signature(what: str, stored: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Raise :class:`SignatureMismatchError` when ``stored`` differs from ``current``."""
    if stored is None:
        return
    diff = signature_diff(stored, current)
    if diff:
        raise SignatureMismatchError(what, diff)
