"""What ``--adacc-policy`` names: nothing, a preset, a policy file, or ``auto``.

Kept apart from :mod:`.auto`, which alone loads the solver (PuLP and its HiGHS library) and the profile
database (sqlite3): a run with a preset or a file never imports them. On the CPU, where the budget is the
process's peak RSS, those libraries are about 5 MiB that no such run should pay.
"""

from __future__ import annotations

from typing import Any

from megatron_adacc.adacc.integration.checks import UnsupportedConfigError
from megatron_adacc.adacc.policy.io import load_policy
from megatron_adacc.adacc.policy.policy import Policy, preset_key
from megatron_adacc.adacc.policy.signature import model_signature


def resolve_policy(args: Any, config: Any, *, isolate: bool = False) -> Policy | str | None:
    """What ``--adacc-policy`` names: None (``none``), a preset name, the ``auto`` policy (profiled in a child
    process with ``isolate``), or a file's policy (checked against this model's signature)."""
    spec = getattr(args, "adacc_policy", "none") or "none"
    key = spec.replace("_", "-").lower()
    if key == "none":
        return None
    if key == "auto":
        from megatron_adacc.adacc.integration.auto import make_policy

        return make_policy(args, config, isolate=isolate)
    if preset_key(key) is not None:
        return Policy.preset(key, config.num_layers)
    return check_layer_count(load_policy(spec, signature=model_signature(config, args)), config, spec)


def check_layer_count(policy: Policy, config: Any, source: str) -> Policy:
    """``policy`` when it can run on this model: every layer's decisions (each pipeline stage installs its slice)
    or, under pipeline parallelism, one stage's (every stage installs the same); else one line, before anything is
    built. (A signed policy was checked whole against the model's signature already.)"""
    pipeline = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    fits = {config.num_layers, config.num_layers // pipeline}
    if policy.num_layers not in fits:
        stage = f" or one pipeline stage's {config.num_layers // pipeline}" if pipeline > 1 else ""
        raise UnsupportedConfigError(
            f"the policy {source} has {policy.num_layers} layers but this model has {config.num_layers}{stage} "
            f"(--num-layers); make the policy for this model (adacc solve ... --num-layers {config.num_layers})")
    return policy
