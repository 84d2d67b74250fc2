"""The one-call Python API: ``megatron_adacc.install(model, policy="auto", budget="30GiB", micro_batch_size=8)``.

For users who build a megatron-core ``GPTModel`` in their own training loop rather than through ``adacc train``
or Megatron-LM's ``pretrain_gpt.py``. It does what ``--adacc-policy`` does in those hosts (profile once, solve the
MILP under the budget, route every ``TransformerLayer`` through the chosen policy), and its errors name its
arguments, not the hosts' flags. What the hosts add on top, a training step at a time (policy evolution, the
end-of-run memory report), needs their loop and is not part of this call.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

__all__ = ["install", "uninstall"]

log = logging.getLogger("megatron_adacc")


def install(model_or_config: Any, policy: Any = "auto", *, budget: int | str | None = None,
            micro_batch_size: int | None = None, seq_length: int | None = None, codec: str | None = None,
            headroom: float | None = None, profile_db: str | os.PathLike | None = None,
            predict_memory: bool | None = None) -> Any:
    """Run the transformer layers of ``model_or_config`` under an Adacc policy (idempotent; :func:`uninstall`
    undoes it).

    Args:
        model_or_config: a megatron-core model (``GPTModel``, or any module with a ``.config``) or the
            ``TransformerConfig`` it is built from. Call it before the first forward; models built later from
            the same config are covered too.
        policy: ``"auto"`` (profile one layer, solve for ``budget``), a preset (``"keep"``, ``"recompute"``,
            ``"quantize-all"``), a policy file written by ``adacc solve``, a
            :class:`~megatron_adacc.adacc.policy.Policy`, or ``None`` / ``"none"`` (uninstall).
        budget: memory for the whole training process, in bytes or as text (``"30GiB"``, ``"800MB"``);
            ``"auto"`` only. Default: the device's memory.
        micro_batch_size: samples per forward pass, which activations scale with. Needed by ``"auto"``, and
            checks a policy file's model signature when given.
        seq_length: tokens per sample. Default: the model's ``max_sequence_length``.
        codec: what compressed tensors use: ``"int4"`` (default), ``"gact"``, or ``"none"`` (keep or
            recompute only: bit-identical gradients).
        headroom: fraction of ``budget`` left free for what the cost model does not see (default 0.01).
        profile_db: the SQLite file profiles are kept in (default ``$ADACC_PROFILE_DB`` or
            ``~/.cache/megatron-adacc/profile.sqlite``).
        predict_memory: profile each layer's per-op sizes at its first forward, for
            :func:`megatron_adacc.adacc.runtime.memory_report`.

    Returns:
        The policy installed (a preset stays its name until the first forward sizes it), or None.

    Example::

        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=50304, max_sequence_length=1024)
        megatron_adacc.install(model, "auto", budget="30GiB", micro_batch_size=8)
    """
    from megatron_adacc.adacc import integration

    if policy is None or (isinstance(policy, str) and policy.strip().lower() == "none"):
        integration.uninstall()
        return None
    config, model = _config_of(model_or_config)
    args = _arguments(config, model, policy, budget=budget, micro_batch_size=micro_batch_size,
                      seq_length=seq_length, codec=codec, headroom=headroom, profile_db=profile_db)
    return integration.install(_policy(policy, config, args), config, predict_memory=predict_memory)


def uninstall() -> None:
    """Undo :func:`install`: Megatron's own entry points and recompute settings back."""
    from megatron_adacc.adacc import integration

    integration.uninstall()


def _config_of(target: Any) -> tuple[Any, Any]:
    """(TransformerConfig, model or None) of what :func:`install` was given."""
    from megatron.core.transformer import TransformerConfig

    if isinstance(target, TransformerConfig):
        return target, None
    config = getattr(target, "config", None)
    if isinstance(config, TransformerConfig):
        return config, target
    if isinstance(target, (str, os.PathLike)) or target is None:
        raise TypeError(f"install(model_or_config, policy=...): the first argument is the model or its "
                        f"TransformerConfig, got {target!r}; the policy is the second, e.g. "
                        f"install(model, {target!r})")
    raise TypeError(f"install(model_or_config, ...) takes a megatron-core model or TransformerConfig, "
                    f"got {type(target).__name__}")


def _arguments(config: Any, model: Any, policy: Any, *, budget: int | str | None, micro_batch_size: int | None,
               seq_length: int | None, codec: str | None, headroom: float | None,
               profile_db: str | os.PathLike | None) -> SimpleNamespace:
    """The run's arguments as the hosts' flags would give them: every Adacc flag at its default, then these."""
    from megatron_adacc import features
    from megatron_adacc.core.units import parse_positive_bytes

    args = SimpleNamespace(**vars(features.add_args(argparse.ArgumentParser()).parse_args([])))
    if budget is not None:
        try:
            args.adacc_memory_budget = parse_positive_bytes(budget)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"budget={budget!r}: {exc}") from None
    if headroom is not None:
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom={headroom!r} must be a fraction in [0, 1)")
        args.adacc_memory_headroom = float(headroom)
    if codec is not None:
        if codec not in ("int4", "gact", "none"):
            raise ValueError(f"codec={codec!r} must be one of 'int4', 'gact', 'none'")
        args.adacc_codec = codec
    args.adacc_profile_db = os.fspath(profile_db) if profile_db is not None else None
    args.micro_batch_size = _positive("micro_batch_size", micro_batch_size)
    args.seq_length = _positive("seq_length", seq_length if seq_length is not None else
                                getattr(model, "max_sequence_length", None))
    args.position_embedding_type = getattr(model, "position_embedding_type", "learned_absolute")
    args.attention_backend = _attention_backend_of(model)
    # the model signature's vocabulary and embeddings, where a model says them (a bare config does not)
    args.vocab_size = getattr(model, "vocab_size", None)
    args.untie_embeddings_and_output_weights = not getattr(model, "share_embeddings_and_output_weights", True)
    args.bf16, args.fp16 = bool(config.bf16), bool(config.fp16)
    args.device = _device_of(model)
    args.seed = 1234  # the profiling batch's draw (Megatron's default seed); the caller's RNG is left as it was
    args.adacc_policy = policy if isinstance(policy, str) else "file"
    if _is_auto(policy):
        for name in ("micro_batch_size", "seq_length"):
            if getattr(args, name) is None:
                raise TypeError(f"install(..., policy='auto') needs {name}=: the activations the budget is solved "
                                "for scale with it")
    return args


def _positive(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def _attention_backend_of(model: Any) -> str | None:
    """The ``--attention-backend`` that builds ``model``'s core attention, so ``auto`` profiles the same layer
    (None, the default, for a bare config: megatron-core's DotProductAttention)."""
    if model is None:
        return None
    from megatron_adacc.models import ATTENTION_BACKENDS, BACKEND_KINDS
    from megatron_adacc.models.attention import attention_kind

    kinds = {attention_kind(m) for m in model.modules()} - {None}
    return next((name for name in ATTENTION_BACKENDS if BACKEND_KINDS[name] in kinds), None)


def _device_of(model: Any) -> str:
    """The device the model's parameters are on (``auto`` for a bare config: CUDA when there is one)."""
    parameter = next(model.parameters(), None) if model is not None and hasattr(model, "parameters") else None
    return "auto" if parameter is None else parameter.device.type


def _is_auto(policy: Any) -> bool:
    return isinstance(policy, str) and policy.strip().lower() == "auto"


def _policy(policy: Any, config: Any, args: SimpleNamespace) -> Any:
    """What ``policy`` names, for this model: the solved ``auto`` policy, a preset, or a checked policy file."""
    from megatron_adacc.adacc.integration.auto import make_policy
    from megatron_adacc.adacc.policy.io import load_policy
    from megatron_adacc.adacc.policy.policy import PRESET_NAMES, Policy, preset_key
    from megatron_adacc.adacc.policy.signature import model_signature

    if isinstance(policy, Policy):
        return policy
    if _is_auto(policy):
        with _rng_preserved():
            return make_policy(args, config, log=log.info)
    if isinstance(policy, str) and preset_key(policy) is not None:
        return policy
    if not isinstance(policy, (str, os.PathLike)):
        raise TypeError(f"policy= takes 'auto', a preset, a policy file or a Policy, got {type(policy).__name__}")
    if not os.path.isfile(policy):
        raise FileNotFoundError(f"policy={os.fspath(policy)!r} is neither 'auto', a preset "
                                f"({', '.join(PRESET_NAMES)}, none) nor an existing policy file")
    signature = model_signature(config, args) if args.micro_batch_size and args.seq_length else None
    return load_policy(policy, signature=signature)


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    """Profiling builds and runs a one-layer model, which draws from torch's and Megatron's random streams; the
    hosts profile in a child process for that reason. Here the caller's streams are restored instead, so that
    a model built after ``install`` gets the weights and dropout masks it would have got without it."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracked = tracker.get_states()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            tracker.set_states(tracked)
