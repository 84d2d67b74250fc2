"""Megatron-LM's pretrain script as a :class:`~megatron_adacc.core.host.Host`: it runs a short version of its own
command line in a child process, so that ``--adacc-policy auto`` calibrates its CPU budget under
``pretrain_gpt.py`` as it does under ``adacc train`` (:mod:`megatron_adacc.training.host`).

The child is this process's own command (``sys.orig_argv``: the interpreter's flags, ``-m`` or the script, and
every argument), started as a world of one. Megatron-LM's argument parser is not ours to extend with values
that have no flag, so the changes travel in a request file named by :data:`MEASURE_ENV`: the child's
:func:`~megatron_adacc.megatron_lm.session.configure` applies them to the parsed arguments
(:func:`apply_request`) and writes its peak memory and its extensions' reports when the process exits.

Only a run of one process calibrates: a calibration of a tensor- or pipeline-parallel run would have to start
every rank again, so those runs count the resident size and say so.
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


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class MegatronLMHost(Host):
    """``pretrain_gpt.py`` (or any script that calls :func:`~megatron_adacc.megatron_lm.configure`)."""

    name = "pretrain_gpt.py"

    @property
    def runs_training(self) -> bool:  # type: ignore[override]
        return _world_size() == 1 and not os.environ.get(MEASURE_ENV)

    def measure_run(self, args: Any, env: dict[str, str] | None = None, **overrides: Any) -> dict | None:
        from megatron_adacc.compat.process import free_port, solo_environment
        from megatron_adacc.core.log import get_logger

        if not self.runs_training:
            return None
        with tempfile.TemporaryDirectory(prefix="adacc-measure-") as folder:
            request, result = Path(folder) / "request.json", Path(folder) / "result.json"
            request.write_text(json.dumps({"overrides": {**_QUIET, **overrides}, "result": str(result)}))
            child_env = {**solo_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                         "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                         **(env or {}), MEASURE_ENV: str(request)}
            proc = subprocess.run(list(sys.orig_argv), env=child_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0 or not result.is_file():
                tail = "\n".join(proc.stdout.splitlines()[-_TAIL:])
                get_logger().warning(f"the measuring run of this command exited with {proc.returncode}; its "
                                     f"last lines:\n{tail}")
                return None
            return json.loads(result.read_text())


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

    atexit.register(_write_result, request["result"], lambda: peak_memory_bytes(torch.device("cpu")))


def _write_result(path: str, peak: Callable[[], int]) -> None:
    from megatron_adacc.megatron_lm.session import current_session

    session = current_session()
    extensions = session.report() if session is not None and session.attached else {}
    Path(path).write_text(json.dumps({"peak_memory_bytes": peak(), "extensions": extensions}, default=str))
