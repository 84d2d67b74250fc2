"""``--adacc-policy auto`` profiles in a process of its own.

The profiler builds a one-layer model, runs it many times and draws random numbers. Done inside the training
process, its peak would count against the memory budget of the run that asked for it (peak RSS on the CPU
keeps it for good), and its draws would shift the run's random streams, so that a run with a cold profile
cache trained differently from one with a warm cache. In a child, neither happens: the parent only reads the
stored profile back. The child is a world of one whatever launched the parent.

Usage (internal): ``python -m megatron_adacc.adacc.integration.profile_child PAYLOAD`` where PAYLOAD is a
``torch.save`` of ``{"args": ..., "config": ...}``; the child stores the profile and prints its reference as
the last line of standard output.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from megatron_adacc.adacc.policy.profile import LayerProfile
from megatron_adacc.adacc.policy.profile_db import ProfileDB
from megatron_adacc.compat import process
from megatron_adacc.core.devices import resolve_device


def profile_and_store(args: Any, config: Any, device: torch.device, db: ProfileDB,
                      log: Callable[[str], None]) -> tuple[LayerProfile, dict[str, Any]]:
    """Profile one layer of this model here, in this process, and store the profile in ``db``.

    On the CPU the profiler measures memory as resident size, which follows tensors only under the allocator
    setting the budget is measured with (:func:`~megatron_adacc.adacc.runtime.stages.low_fragmentation_malloc`),
    set here before the layer is built: set later, in a process whose heap already served torch's blocks, the
    same backward measured up to 1.7x the bytes (llama-tiny's SwiGLU). It stays set for the process's life."""
    from megatron_adacc.adacc.integration.profiler import device_name, profile_layer
    from megatron_adacc.adacc.integration.sample import layer_sample
    from megatron_adacc.adacc.runtime.stages import low_fragmentation_malloc

    if device.type == "cpu":
        low_fragmentation_malloc()

    log(f"profiling one layer on {device_name(device)} (stored in {db.path})")
    profile = profile_layer(layer_sample(args, config, device), args, config, device=device, log=log,
                            repeats=getattr(args, "repeats", None) or 3)  # `adacc profile --repeats`
    pid = db.put(profile)
    return profile, db.reference(pid, profile)


def payload(args: Any, config: Any) -> bytes | None:
    """The child's input, or None when ``args`` or ``config`` cannot be pickled (then profile in-process)."""
    return process.pickled({"args": args, "config": config})


def profile_in_child(data: bytes, log: Callable[[str], None]) -> dict[str, Any]:
    """Run the profiler in a child process on ``data`` (see :func:`payload`); returns the stored profile's
    reference. The child's log lines go to this process's standard error as they come."""
    ref = process.run_child(__name__, data)
    if ref is None:
        raise RuntimeError("the profiler's child process failed; its error is above. Run `adacc profile` with "
                           "the same flags to see it alone")
    return ref


def main(path: str) -> None:
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.core import log

    log.install()  # at the level the parent chose (ADACC_LOG_LEVEL): its -q is this process's too
    quiet_fallback_warnings()
    data = process.load_payload(path)
    args, config = data["args"], data["config"]
    device = resolve_device(getattr(args, "device", "auto"))
    process.initialize(device, int(getattr(args, "seed", 0) or 0))
    db = ProfileDB(getattr(args, "adacc_profile_db", None))
    _, ref = profile_and_store(args, config, device, db, log.get_logger().info)
    print(json.dumps(ref), flush=True)
    process.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
