"""The model signature: the fields that make a profile or a policy valid for a model configuration."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from megatron_adacc.core.errors import AdaccError

SIGNATURE_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "micro_batch_size",
    "dtype",
    "num_layers",
    "megatron_core_version",
)


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


def model_signature(config: Any, args: Any = None) -> dict[str, Any]:
    """The signature of a model: from its ``TransformerConfig`` and the run's arguments.

    Sequence length and micro-batch size come from ``args`` (``seq_length``, ``micro_batch_size``);
    the rest from the config, with ``args`` as a fallback.
    """
    def get(name: str, *alts: str) -> Any:
        for src in (config, args):
            for n in (name, *alts):
                v = getattr(src, n, None) if src is not None else None
                if v is not None:
                    return v
        return None

    hidden = get("hidden_size")
    sig = {
        "hidden_size": hidden,
        "num_attention_heads": get("num_attention_heads"),
        "ffn_hidden_size": _first(get("ffn_hidden_size"), 4 * hidden if hidden else None),
        "seq_length": get("seq_length", "max_position_embeddings"),
        "micro_batch_size": get("micro_batch_size"),
        "dtype": _dtype_name(config, args),
        "num_layers": get("num_layers"),
        "megatron_core_version": megatron_core_version(),
    }
    missing = [k for k, v in sig.items() if v is None]
    if missing:
        raise ValueError(f"cannot build the model signature: missing {', '.join(missing)} "
                         "(pass them in the TransformerConfig or the arguments)")
    for k in SIGNATURE_FIELDS:
        if k not in ("dtype", "megatron_core_version"):
            sig[k] = int(sig[k])
    return sig


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
