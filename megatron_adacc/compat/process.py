"""One process's torch.distributed and megatron-core model-parallel state (single process or torchrun).

Shared by ``adacc train`` and by the helper processes megatron-adacc starts itself (the profiler's child), which
must come up the same way without importing a host. megatron-core is imported inside the functions, so that
importing this module (``adacc train --help``, the test helpers) does not load it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def initialize(device: torch.device, seed: int, timeout: timedelta | None = None) -> tuple[int, int]:
    """Start torch.distributed (gloo on CPU, nccl on CUDA) and megatron's model-parallel state.

    Works with or without torchrun: a single process becomes rank 0 of a world of 1. Returns (rank, world).
    ``timeout`` bounds every collective of the default group and of megatron's groups (None: torch's and
    megatron's defaults, 30 minutes); past it a collective a rank never joins raises instead of waiting forever.
    """
    from megatron.core import parallel_state

    if device.type == "cpu":
        from megatron_adacc.compat import cpu

        cpu.apply()
    if not torch.distributed.is_initialized():
        backend = "gloo" if device.type == "cpu" else "nccl"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "MASTER_PORT" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
            # A world of one meets through a file: no port to pick, so none another process can take first.
            fd, path = tempfile.mkstemp(prefix="adacc-rendezvous-")
            os.close(fd)
            torch.distributed.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1,
                                                 timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            torch.distributed.init_process_group(backend, timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        minutes = {} if timeout is None else {"distributed_timeout_minutes": timeout.total_seconds() / 60}
        parallel_state.initialize_model_parallel(**minutes)
    set_seed(seed)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def set_seed(seed: int) -> None:
    """Seed python-side torch RNG and megatron's tracker exactly as Megatron-LM's initialize does."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Tear down megatron's state and the process group, so a process can initialize again (tests)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: torchrun's variables: a child that inherited them would try to join its parent's group, or, with
#: ``TORCHELASTIC_USE_AGENT_STORE``, wait forever for a rendezvous store its launcher's agent was to host.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_PREFIX = "TORCHELASTIC_"


def solo_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) for a child process that is its own world of one,
    whatever launched its parent."""
    env = dict(os.environ if base is None else base)
    for name in [*_LAUNCHER_VARIABLES, *(n for n in env if n.startswith(_LAUNCHER_PREFIX))]:
        env.pop(name, None)
    return env


def pickled(obj: Any) -> bytes | None:
    """``obj`` as :func:`run_child` hands it over, or None when it cannot be pickled."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception:  # noqa: BLE001  (any unpicklable attribute, e.g. of a host's Namespace)
        return None
    return buf.getvalue()


def run_child(module: str, data: bytes, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Run ``python -m module PATH`` as its own world of one, PATH a file holding ``data`` (read it back with
    :func:`load_payload`), with ``env`` added to its environment. Its standard error passes through as it
    comes; returns the JSON object it printed last on standard output, or None when it failed."""
    with tempfile.NamedTemporaryFile(suffix=".pt", delete=False) as fh:
        fh.write(data)
        path = fh.name
    try:
        proc = subprocess.run([sys.executable, "-m", module, path], stdout=subprocess.PIPE, stderr=None,
                              text=True, env={**solo_environment(), **(env or {})})
    finally:
        os.unlink(path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if proc.returncode == 0 and lines else None


def forked(work: Callable[[], T]) -> T:
    """``work()`` in a forked child process, its result (or its exception) pickled back: what it imports and
    allocates stays in the child. Where the process cannot fork, ``work()`` here.

    The child runs Python and what ``work`` calls only: a child of a process whose threads held locks (torch's
    thread pools, gloo) must not use torch, nor a library whose own thread pool the parent started (HiGHS's
    child would wait for its threads forever); it never returns into the parent's code (``os._exit``)."""
    if not hasattr(os, "fork"):
        return work()
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12 warns that a threaded process forks; the child above is safe
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            try:
                payload = pickle.dumps(("done", work()))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
                try:
                    payload = pickle.dumps(("raised", exc))
                except Exception:  # noqa: BLE001 - an exception that does not pickle: its words do
                    payload = pickle.dumps(("raised", RuntimeError(f"{type(exc).__name__}: {exc}")))
            with os.fdopen(write, "wb") as pipe:
                pipe.write(payload)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"a forked child process ended without an answer (wait status {status})")
    kind, value = pickle.loads(data)  # from this process's own child
    if kind == "raised":
        raise value
    return value


def load_payload(path: str) -> Any:
    """What :func:`run_child` handed to this process."""
    return torch.load(path, weights_only=False)  # written by this package's parent process a moment ago
