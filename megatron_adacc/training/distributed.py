"""Process-group and model-parallel set-up for `adacc train` (single process or torchrun): the same as every
process megatron-adacc starts, :mod:`megatron_adacc.compat.process`, named here for the host's callers; and
what a rank says when another one stops answering (:func:`naming_frozen_ranks`).

megatron-core (and the CPU layer, which imports it) are imported inside those functions: `adacc train --help`
and the test helpers (:mod:`megatron_adacc.testing`, imported by every test before
``quiet_fallback_warnings()``) import this module without loading megatron-core.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta

import torch

from megatron_adacc.compat.process import free_port, initialize, set_seed, shutdown
from megatron_adacc.core.devices import resolve_device
from megatron_adacc.core.errors import AdaccError

__all__ = ["DEFAULT_TIMEOUT_MINUTES", "RankTimeout", "free_port", "initialize", "naming_frozen_ranks",
           "resolve_device", "set_seed", "shutdown", "timeout_of"]

#: ``--distributed-timeout-minutes`` by default: Megatron-LM's default, long enough for a slow checkpoint write.
DEFAULT_TIMEOUT_MINUTES = 10.0
#: Key prefix, in the rendezvous store, of the ranks that timed out (each live rank writes its own).
_TIMED_OUT = "adacc/timed-out/"


class RankTimeout(AdaccError, RuntimeError):
    """A collective waited past ``--distributed-timeout-minutes``: some rank stopped answering."""

    every_rank = True  # rank 0 may be the one that stopped


def timeout_of(minutes: float | None) -> timedelta:
    """``--distributed-timeout-minutes`` as the process group takes it."""
    return timedelta(minutes=DEFAULT_TIMEOUT_MINUTES if minutes is None else minutes)


def _is_timeout(exc: BaseException) -> bool:
    # gloo: "Timed out waiting 6000ms for recv operation"; the store: "Wait timeout", "Socket Timeout".
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def _grace(timeout: timedelta) -> timedelta:
    """How long a rank that timed out waits for the others to say they timed out too. Every rank still alive
    was waiting in the same collective, so they time out within a step's skew of each other."""
    return timedelta(seconds=min(15.0, max(2.0, timeout.total_seconds() / 4)))


def _silent_ranks(rank: int, world: int, grace: timedelta) -> list[int] | None:
    """The ranks that did not say, within ``grace``, that they timed out too: the frozen ones (a stopped
    process says nothing). Goes through the rendezvous store, which does not depend on the process group's
    broken collective; None when the store cannot be reached either."""
    try:
        store = torch.distributed.distributed_c10d._get_default_store()
        store.set_timeout(grace)
        store.set(f"{_TIMED_OUT}{rank}", "1")
        deadline = time.monotonic() + grace.total_seconds()
        while True:  # polled: store.wait would log a c10d warning for the ranks that never answer
            silent = [r for r in range(world) if r != rank and not store.check([f"{_TIMED_OUT}{r}"])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.2)
    except RuntimeError:
        return None


def _message(silent: list[int] | None, world: int, timeout: timedelta) -> str:
    waited = f"{timeout.total_seconds():g} s (--distributed-timeout-minutes {timeout.total_seconds() / 60:g})"
    if silent is None:
        who = "a rank"
    elif not silent:
        return (f"every rank waited {waited} in a collective the others were not in (a rank took another code "
                "path); rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to see which collective each rank was in")
    else:
        who = ("rank " if len(silent) == 1 else "ranks ") + ", ".join(map(str, silent))
    return (f"{who} of {world} did not answer for {waited}: it is stopped (SIGSTOP, a debugger), hung or far "
            "slower than the others; check that process (py-spy dump --pid PID), or raise "
            "--distributed-timeout-minutes if it is only slow")


@contextlib.contextmanager
def naming_frozen_ranks(timeout: timedelta) -> Iterator[None]:
    """Turn a collective's timeout into :class:`RankTimeout` naming the ranks that did not answer, so that a
    frozen rank ends the job with one line and a non-zero exit (the launcher then stops the others) instead of
    the bare transport error, which names no rank."""
    try:
        yield
    except RuntimeError as exc:
        alone = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
        if isinstance(exc, AdaccError) or alone or not _is_timeout(exc):
            raise
        world = torch.distributed.get_world_size()
        silent = _silent_ranks(torch.distributed.get_rank(), world, _grace(timeout))
        raise RankTimeout(_message(silent, world, timeout)) from exc
