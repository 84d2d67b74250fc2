"""``adacc train`` as a :class:`~megatron_adacc.core.host.Host`: it can run a short version of the user's own
command in a process of its own and report its peak memory (``--adacc-policy auto`` calibrates its CPU budget
with one).

Usage (internal): ``python -m megatron_adacc.training.host PAYLOAD``, PAYLOAD a ``torch.save`` of the parsed
arguments; prints ``{"peak_memory_bytes": N}`` as the last line of standard output.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import torch

from megatron_adacc.compat.process import solo_environment
from megatron_adacc.core.host import Host

#: What a measuring run leaves out of the user's command: it writes nothing, evaluates nothing, shows nothing.
_QUIET = {"save": None, "save_interval": None, "load": None, "output_json": None, "eval_iters": 0,
          "no_progress": True}


class TrainHost(Host):
    """``adacc train``."""

    name = "adacc train"
    runs_training = True

    def peak_memory_bytes(self, args: Any, env: dict[str, str] | None = None, **overrides: Any) -> int | None:
        child_args = SimpleNamespace(**{**vars(args), **_QUIET, **overrides})
        buf = io.BytesIO()
        torch.save(child_args, buf)
        with tempfile.NamedTemporaryFile(suffix=".pt", delete=False) as fh:
            fh.write(buf.getvalue())
            path = fh.name
        try:
            proc = subprocess.run([sys.executable, "-m", __name__, path], stdout=subprocess.PIPE, stderr=None,
                                  text=True, env={**solo_environment(), **(env or {})})
        finally:
            os.unlink(path)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            return None
        return int(json.loads(lines[-1])["peak_memory_bytes"])


def main(path: str) -> None:
    from megatron_adacc.training.loop import train

    args = torch.load(path, weights_only=False)  # written by this package's parent process a moment ago
    summary = train(args)
    print(json.dumps({"peak_memory_bytes": summary["peak_memory_bytes"]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
