"""Megatron-LM's pretrain script as a :class:`~megatron_adacc.core.host.Host`: it runs a short version of its own
command line in a child process, so that ``--adacc-policy auto`` calibrates its CPU budget under
``pretrain_gpt.py`` as it does under ``adacc train`` (:mod:`megatron_adacc.training.host`).

The child is this process's own command (``sys.orig_argv``: the interpreter's flags, ``-m`` or the script, and
every argument), started as a world of one for a run of one process. Megatron-LM's argument parser is not
ours to extend with values that have no flag, so the changes travel in a request file named by
:data:`MEASURE_ENV`: the child's
:func:`~megatron_adacc.megatron_lm.session.configure` applies them to the parsed arguments
(:func:`apply_request`) and writes its peak memory and its extensions' reports when the process exits.

A run of several processes on one machine (tensor, pipeline or data parallel, as torchrun starts it) is
measured by as many children, started by torchrun from rank 0 while the other ranks wait; each child rank
writes its own figures (:func:`measured_ranks`). A run over several machines counts its resident size and
says so.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_adacc.core.host import Host
from megatron_adacc.megatron_lm.session import MEASURE_ENV

__all__ = ["MEASURE_ENV", "MegatronLMHost", "apply_request"]
#: What a measuring run leaves out of the user's command: it writes, loads and evaluates nothing.
_QUIET = {"save": None, "load": None, "save_interval": None, "eval_iters": 0, "exit_interval": None,
          "tensorboard_dir": None, "wandb_project": None}
#: Lines of a failed child's output shown with the failure.
_TAIL = 40


def _world() -> tuple[int, int]:
    """(processes in this run, processes on this machine)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


#: Interpreter options that take a value (``python -W error script.py``).
_VALUED_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")


def child_command(argv: list[str], processes: int, port: int) -> list[str]:
    """``argv`` (``sys.orig_argv``: the interpreter, its options, ``-m module`` / ``-c code`` / a script, and
    its arguments) as the command of a measuring run of ``processes``: itself for one, torchrun around what
    it runs for more (torchrun gives each rank its variables)."""
    if processes == 1:
        return list(argv)
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c"):
        i += 2 if argv[i] in _VALUED_OPTIONS else 1
    if i >= len(argv) or argv[i] == "-c":
        raise ValueError(f"cannot start {' '.join(argv)!r} again under torchrun: it runs no script or module")
    target = ["-m", argv[i + 1]] if argv[i] == "-m" else [argv[i]]
    rest = argv[i + len(target):]
    return [argv[0], "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--master_addr=127.0.0.1",
            f"--master_port={port}", *target, *rest]


class MegatronLMHost(Host):
    """``pretrain_gpt.py`` (or any script that calls :func:`~megatron_adacc.megatron_lm.configure`)."""

    name = "pretrain_gpt.py"

    @property
    def runs_training(self) -> bool:  # type: ignore[override]
        world, here = _world()
        return world == here and not os.environ.get(MEASURE_ENV)

    def measure_run(self, args: Any, env: dict[str, str] | None = None, **overrides: Any) -> dict | None:
        """The measuring run's figures: rank 0's ``peak_memory_bytes`` and ``extensions``, and under
        ``ranks`` every rank's, in rank order."""
        from megatron_adacc.compat.process import free_port, solo_environment
        from megatron_adacc.core.log import get_logger

        if not self.runs_training:
            return None
        world, _ = _world()
        with tempfile.TemporaryDirectory(prefix="adacc-measure-") as folder:
            request, result = Path(folder) / "request.json", Path(folder) / "result"
            request.write_text(json.dumps({"overrides": {**_QUIET, **overrides}, "result": str(result)}))
            port = free_port()
            try:
                command = child_command(list(sys.orig_argv), world, port)
            except ValueError as exc:
                get_logger().warning(f"no measuring run: {exc}")
                return None
            child_env = {**solo_environment(), **(env or {}), MEASURE_ENV: str(request)}
            if world == 1:
                child_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                                  "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
            proc = subprocess.run(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            ranks = measured_ranks(result, world)
            if proc.returncode != 0 or ranks is None:
                tail = "\n".join(proc.stdout.splitlines()[-_TAIL:])
                get_logger().warning(f"the measuring run of this command exited with {proc.returncode}; its "
                                     f"last lines:\n{tail}")
                return None
            return {**ranks[0], "ranks": ranks}


def measured_ranks(result: Path, world: int) -> list[dict] | None:
    """Each child rank's figures (:func:`apply_request` writes ``result.rankN``), or None if one is missing."""
    files = [result.with_name(f"{result.name}.rank{rank}") for rank in range(world)]
    if not all(f.is_file() for f in files):
        return None
    return [json.loads(f.read_text()) for f in files]


def apply_request(args: Any) -> None:
    """In a measuring child: apply the parent's changes to ``args`` and write the run's figures at exit."""
    path = os.environ.get(MEASURE_ENV)
    if not path:
        return
    request = json.loads(Path(path).read_text())
    for name, value in request["overrides"].items():
        setattr(args, name, value)
    # imported now: an import at exit could not register its own exit handlers (torch's)
    import torch

    from megatron_adacc.core.devices import peak_memory_bytes

    atexit.register(_write_result, f"{request['result']}.rank{os.environ.get('RANK', '0')}",
                    lambda: peak_memory_bytes(torch.device("cpu")))


def _write_result(path: str, peak: Callable[[], int]) -> None:
    from megatron_adacc.megatron_lm.session import current_session

    session = current_session()
    extensions = session.report() if session is not None and session.attached else {}
    Path(path).write_text(json.dumps({"peak_memory_bytes": peak(), "extensions": extensions}, default=str))
