"""Glue into megatron-core: route every ``TransformerLayer`` through the Adacc checkpoint function.

Usage (what ``adacc train --adacc-policy ...`` does; users call :func:`megatron_adacc.install`, which also
solves ``auto``)::

    from megatron_adacc.adacc import integration
    integration.install(policy, config)   # Policy, a preset name, or a policy-file path
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), ...)
    ...
    integration.uninstall()

How: megatron's full-recompute entry point is replaced by a dispatcher, and ``config`` is switched to full
recompute (``uniform``, one layer per chunk) so that ``TransformerBlock.forward`` calls it in training. The
dispatcher runs each layer through :func:`megatron_adacc.adacc.runtime.checkpointed_layer_forward` with that layer's
decisions when ``config`` carries an Adacc policy, and calls Megatron's original otherwise, so models built
from other configs (or with policy ``none``) are untouched. Evaluation (``model.eval()``) never reaches the
entry point and runs Megatron's plain forward.

``install`` may run before or after the model is built, as long as the model uses the same ``config``
object; calling it *before* building surfaces configuration errors before any weights are allocated.

Entry points (version-guarded through :mod:`megatron_adacc.compat.versions`):

* 0.16 line: the method ``TransformerBlock._checkpointed_forward``;
* 0.17+ / 0.19 line: the module function ``megatron.core.recompute.checkpointed_forward``, which
  ``transformer_block`` imports by name, so the name is replaced in every module that imported it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from pathlib import Path
from typing import Any

from megatron_adacc.adacc.integration.checks import UnsupportedConfigError, check_config, check_layer
from megatron_adacc.adacc.runtime import accounting
from megatron_adacc.adacc.runtime.capacity import CAPACITIES
from megatron_adacc.core.patching import is_patched, patch, target, unpatch

__all__ = ["install", "uninstall", "is_installed", "installed_policy", "build_extension", "UnsupportedConfigError",
           "check_config", "check_layer", "entry_points"]

_CHECKED_ATTR = "_megatron_adacc_layer_checked"  # set on a layer once check_layer accepted it
_CONFIG_ATTR = "_megatron_adacc_policy"
_SAVED_ATTR = "_megatron_adacc_saved_recompute"
_RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")

# Module that defines the entry point, attribute path inside it, and modules that import it by name.
_ENTRY_016 = ("megatron.core.transformer.transformer_block", "TransformerBlock._checkpointed_forward", ())
_ENTRY_019 = ("megatron.core.recompute", "checkpointed_forward",
              ("megatron.core.transformer.transformer_block", "megatron.core.transformer.multi_token_prediction",
               "megatron.core.models.hybrid.hybrid_block", "megatron.core.ssm.mamba_block"))

_STATE: dict[str, Any] = {"patched": [], "configs": [], "predict_memory": True, "profiled": set()}


def entry_points(line: tuple[int, int]) -> tuple[str, str, tuple[str, ...]]:
    """Where megatron-core release line ``line`` keeps full recompute: (module, attribute path, importers)."""
    if line >= (0, 17):
        return _ENTRY_019
    if line >= (0, 13):
        return _ENTRY_016
    raise UnsupportedConfigError(f"megatron-core {line[0]}.{line[1]} predates the supported lines (0.16, 0.19)")


# ------------------------------------------------------------------------------------------------ policy
def _load_policy(spec: Any) -> Any:
    """A ``Policy``, a preset name (resolved per model at first forward), or a policy file path."""
    from megatron_adacc.adacc.policy.policy import PRESET_NAMES, Policy, preset_key

    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        text = str(spec)
        if preset_key(text) is not None:
            return text
        path = Path(text)
        if not path.exists():
            raise FileNotFoundError(
                f"--adacc-policy {text!r} is neither a preset ({', '.join(PRESET_NAMES)}, none) nor an existing "
                "policy file")
        from megatron_adacc.adacc.policy.io import load_policy

        return load_policy(path)
    raise TypeError(f"policy must be a megatron_adacc.adacc.policy.Policy, a preset name or a path, got {type(spec)!r}")


def _resolve(block: Any, spec: Any) -> Any:
    """The policy for this block's layers; a preset name or a whole-model policy under pipeline parallelism
    becomes this stage's own policy once, at its first forward."""
    from megatron_adacc.adacc.policy.policy import Policy

    n = len(block.layers)
    if isinstance(spec, str):
        policy = Policy.preset(spec, n)
    elif spec.num_layers == block.config.num_layers and spec.num_layers != n:
        first = getattr(block.layers[0], "layer_number", 1) - 1 if n else 0  # global, 1-based in megatron-core
        policy = spec.stage(first, n)
    elif spec.num_layers != n:
        raise UnsupportedConfigError(
            f"the Adacc policy has {spec.num_layers} layers but this model (pipeline stage) has {n}; make the "
            f"policy for this model (adacc solve ... --num-layers {n}) or use Policy.uniform(..., {n})")
    else:
        return spec
    setattr(block.config, _CONFIG_ATTR, policy)
    accounting.set_policy(policy)
    return policy


def layer_tiles(block: Any) -> list[int]:
    """The token tiles each of ``block``'s layers re-runs its MLP in under the policy installed now (1: none)."""
    from megatron_adacc.adacc.policy.policy import check_tiles

    spec = getattr(block.config, _CONFIG_ATTR, None)
    if spec is None:
        return [1] * len(block.layers)
    policy = _resolve(block, spec)
    return [check_tiles(policy.layer_decisions(i)) for i in range(len(block.layers))]


# ------------------------------------------------------------------------------------------------ dispatcher
def _run_policy(block: Any, policy: Any, args: dict[str, Any]) -> Any:
    from megatron_adacc.adacc.policy.ops import Action
    from megatron_adacc.adacc.runtime.checkpoint import (
        checkpointed_layer_forward,
        recomputed_layer_forward,
        recomputes_whole_layer,
        stock_layer_forward,
    )
    from megatron_adacc.adacc.runtime.memory import _codecs_of, profile_layer_sizes
    from megatron_adacc.adacc.runtime.ops import repeats_kv

    if args.get("context") is not None or args.get("context_mask") is not None:
        raise UnsupportedConfigError("cross attention (context) is not supported under an Adacc policy")
    if args.get("attention_bias") is not None:
        raise UnsupportedConfigError("attention_bias is not supported by the local DotProductAttention")
    if args.get("packed_seq_params") is not None:
        raise UnsupportedConfigError("packed sequences (THD) need transformer-engine attention; not supported")
    hidden_states = args["hidden_states"]
    extract = args.get("extract_layer_indices") or set()
    offset = args.get("layer_offset", 0) or 0
    intermediates = []
    for index, layer in enumerate(block.layers):
        if not getattr(layer, _CHECKED_ATTR, False):
            check_layer(layer)
            setattr(layer, _CHECKED_ATTR, True)
        decisions = policy.layer_decisions(index)
        if _STATE["predict_memory"] and accounting.is_enabled() and (id(block), index) not in _STATE["profiled"]:
            _STATE["profiled"].add((id(block), index))
            accounting.record_sizes(index, profile_layer_sizes(
                layer, hidden_states, args.get("attention_mask"), args.get("rotary_pos_emb"),
                codecs=_codecs_of(decisions)))
        if all(d.action == Action.KEEP for d in decisions.values()) and not repeats_kv(layer):
            forward = stock_layer_forward
        elif recomputes_whole_layer(layer, decisions):
            forward = functools.partial(recomputed_layer_forward, decisions=decisions)
        else:
            forward = functools.partial(checkpointed_layer_forward, decisions=decisions)
        hidden_states = forward(layer, hidden_states=hidden_states, attention_mask=args.get("attention_mask"),
                                rotary_pos_emb=args.get("rotary_pos_emb"), layer_index=index)
        if index + offset in extract:
            intermediates.append(hidden_states)
    if extract:
        return hidden_states, intermediates
    return hidden_states


def _make_dispatcher(original: Any) -> Any:
    signature = inspect.signature(original)

    def checkpointed_forward(self, *args, **kwargs):
        spec = getattr(self.config, _CONFIG_ATTR, None)
        if spec is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return _run_policy(self, _resolve(self, spec), dict(bound.arguments))

    functools.update_wrapper(checkpointed_forward, original)  # before the docstring: it would overwrite it
    checkpointed_forward.__doc__ = (original.__doc__ or "") + "\n\n(Routed through megatron-adacc's policy runtime.)"
    return checkpointed_forward


def _patch_entry_point() -> None:
    """Replace megatron's full-recompute entry point with the dispatcher (idempotent, version-guarded)."""
    if _STATE["patched"]:
        return
    from megatron_adacc.compat.versions import megatron_line

    module_name, attr_path, importers = entry_points(megatron_line())
    why = "megatron's full-recompute entry point, which megatron-adacc routes through its policy runtime"
    owner: Any = importlib.import_module(module_name)
    *owners, attr = attr_path.split(".")
    for name in owners:
        owner = target(owner, name, why)
    original = target(owner, attr, why)
    if is_patched(original):
        return
    replacement = patch(owner, attr, _make_dispatcher, why)
    _STATE["patched"].append((owner, attr))
    for name in importers:
        try:
            importer = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(importer, attr, None) is original:
            patch(importer, attr, lambda _original: replacement, why)
            _STATE["patched"].append((importer, attr))


# ------------------------------------------------------------------------------------------------ public API
def install(policy: Any, config: Any = None, *, predict_memory: bool | None = None) -> Any | None:
    """Run every ``TransformerLayer`` of models built from ``config`` under ``policy`` (idempotent).

    Args:
        policy: a :class:`megatron_adacc.adacc.policy.Policy`, a preset name (``keep``, ``recompute``,
            ``quantize-all``; sized to the model at its first forward), a policy-file path, or ``None`` /
            ``"none"`` (uninstall: Megatron untouched).
        config: the megatron-core ``TransformerConfig`` the model is (or will be) built from.
        predict_memory: profile each layer's per-op sizes at its first forward (one extra layer forward, no
            backward) so :func:`megatron_adacc.adacc.runtime.memory_report` can give predicted next to measured bytes.
            Benchmarks of peak memory turn it off. ``None`` keeps the current setting (on at the first
            install), so that a policy switch during training neither turns it back on nor profiles again.

    Returns:
        The policy object (a preset stays a string until the first forward).

    Raises:
        UnsupportedConfigError: ``config`` uses a feature the runtime does not support (the message names the flag).
    """
    if policy is None or (isinstance(policy, str) and policy.lower() == "none"):
        uninstall()
        return None
    if config is None:
        raise TypeError("install(policy, config=...) needs the model's TransformerConfig")
    spec = _load_policy(policy)
    already = getattr(config, _CONFIG_ATTR, None) is not None
    check_config(config, ours=already)
    _patch_entry_point()
    if not already:
        setattr(config, _SAVED_ATTR, {name: getattr(config, name) for name in _RECOMPUTE_FIELDS})
        _STATE["configs"].append(config)
    config.recompute_granularity = "full"
    config.recompute_method = "uniform"
    config.recompute_num_layers = 1
    setattr(config, _CONFIG_ATTR, spec)
    accounting.set_policy(spec)
    if predict_memory is not None:
        _STATE["predict_memory"] = bool(predict_memory)
        _STATE["profiled"] = set()
    accounting.clear()
    return spec


def uninstall() -> None:
    """Undo :func:`install`: original entry points back, configs' recompute fields restored."""
    for owner, attr in reversed(_STATE["patched"]):
        unpatch(owner, attr)
    _STATE["patched"] = []
    for config in _STATE["configs"]:
        saved = getattr(config, _SAVED_ATTR, None) or {}
        for name, value in saved.items():
            setattr(config, name, value)
        for attr in (_CONFIG_ATTR, _SAVED_ATTR):
            if hasattr(config, attr):
                delattr(config, attr)
    _STATE["configs"] = []
    accounting.set_policy(None)
    CAPACITIES.clear()
    _STATE["predict_memory"] = True
    _STATE["profiled"] = set()


def is_installed() -> bool:
    return bool(_STATE["patched"])


def installed_policy() -> Any:
    """The active policy (a ``Policy`` once the first forward sized a preset), or None."""
    return accounting.policy()


def build_extension(args: Any, config: Any) -> Any:
    """``adacc train``'s extension for ``--adacc-policy`` (see :mod:`megatron_adacc.adacc.integration.extension`)."""
    from megatron_adacc.adacc.integration.extension import build_extension as _build

    return _build(args, config)
