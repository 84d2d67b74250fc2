"""``--adacc-policy auto``: profile if the database has no profile for this device and model, solve, train."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from megatron_adacc.adacc.policy.io import load_policy
from megatron_adacc.adacc.policy.policy import Policy, preset_key
from megatron_adacc.adacc.policy.profile import LayerProfile
from megatron_adacc.adacc.policy.profile_db import ProfileDB
from megatron_adacc.adacc.policy.signature import model_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy
from megatron_adacc.core.devices import resolve_device


def _log(msg: str) -> None:
    print(f"[adacc] {msg}", file=sys.stderr, flush=True)


def _device(args: Any) -> torch.device:
    return resolve_device(getattr(args, "device", "auto"))


def get_or_make_profile(args: Any, config: Any, *, log: Callable[[str], None] = _log,
                        force: bool = False) -> tuple[LayerProfile, dict[str, Any]]:
    """The stored profile for this device and model signature, profiling (and storing) it when missing.

    Profiling builds a one-layer model (:func:`~megatron_adacc.adacc.integration.sample.layer_sample`), which
    draws from the RNG as the real model's construction does."""
    from megatron_adacc.adacc.integration.profiler import device_name, profile_layer
    from megatron_adacc.adacc.integration.sample import layer_sample

    device = _device(args)
    db = ProfileDB(getattr(args, "adacc_profile_db", None))
    sig = model_signature(config, args)
    found = None if force else db.get(device_name(device), sig)
    if found is not None:
        pid, profile = found
        log(f"reusing profile #{pid} from {db.path} ({profile.device})")
        return profile, db.reference(pid, profile)
    log(f"profiling one layer on {device_name(device)} (stored in {db.path})")
    profile = profile_layer(layer_sample(args, config, device), args, config, device=device, log=log)
    pid = db.put(profile)
    return profile, db.reference(pid, profile)


def _resident_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def make_policy(args: Any, config: Any, *, log: Callable[[str], None] = _log) -> Policy:
    """Profile if needed, then solve the MILP under ``--adacc-memory-budget`` (default: the device's memory).

    Raises :class:`~megatron_adacc.adacc.policy.strategies.InfeasibleBudgetError` before training when no policy
    fits, naming the smallest feasible budget.
    """
    from megatron_adacc.adacc.integration.profiler import device_memory_bytes

    device = _device(args)
    if device.type == "cpu" and not getattr(args, "adacc_process_baseline_bytes", None):
        import megatron_adacc.codecs  # noqa: F401  (loads the codec extension, which training will hold too)

        # On the CPU the budget is peak RSS, which also counts the interpreter, torch and megatron-core. Kept on
        # args so that policy evolution re-solves against the same static memory.
        args.adacc_process_baseline_bytes = _resident_bytes()
        log(f"CPU: the budget is peak RSS; counting this process's {args.adacc_process_baseline_bytes / 2**20:.0f}"
            " MiB (interpreter and libraries) as static memory")
    options = SolveOptions.from_args(args)
    profile, ref = get_or_make_profile(args, config, log=log)
    budget = getattr(args, "adacc_memory_budget", None) or device_memory_bytes(device)
    policy, result = solve_policy(profile, budget, options, profile_ref=ref,
                                  signature=model_signature(config, args))
    log(f"policy solved by {result.strategy} in {result.solve_time_s * 1e3:.0f} ms: predicted "
        f"{result.predicted_memory_bytes / 2**30:.3f} GiB of {budget / 2**30:.3f} GiB, "
        f"overhead {result.predicted_time_s * 1e3:.1f} ms per micro-batch")
    return policy


def resolve_policy(args: Any, config: Any) -> Policy | str | None:
    """What ``--adacc-policy`` names: None (``none``), a preset name, the ``auto`` policy, or a file's policy
    (checked against this model's signature)."""
    spec = getattr(args, "adacc_policy", "none") or "none"
    key = spec.replace("_", "-").lower()
    if key == "none":
        return None
    if key == "auto":
        return make_policy(args, config)
    if preset_key(key) is not None:
        return Policy.preset(key, config.num_layers)
    return load_policy(spec, signature=model_signature(config, args))
