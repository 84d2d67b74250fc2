"""``adacc train`` as a :class:`~megatron_adacc.core.host.Host`: it can run a short version of the user's own
command in a process of its own and report its peak memory and its extensions' reports (``--adacc-policy auto``
calibrates its CPU budget with one).

Usage (internal): ``python -m megatron_adacc.training.host PAYLOAD``, PAYLOAD a ``torch.save`` of the parsed
arguments; prints ``{"peak_memory_bytes": N, "extensions": {...}}`` as the last line of standard output.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

from megatron_adacc.compat.process import load_payload, pickled, run_child
from megatron_adacc.core.host import Host

#: What a measuring run leaves out of the user's command: it writes nothing, evaluates nothing, shows nothing.
_QUIET = {"save": None, "save_interval": None, "load": None, "output_json": None, "eval_iters": 0,
          "no_progress": True}


class TrainHost(Host):
    """``adacc train``."""

    name = "adacc train"
    runs_training = True

    def measure_run(self, args: Any, env: dict[str, str] | None = None, **overrides: Any) -> dict | None:
        data = pickled(SimpleNamespace(**{**vars(args), **_QUIET, **overrides}))
        return run_child(__name__, data, env) if data is not None else None


def main(path: str) -> None:
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.core import log
    from megatron_adacc.training.loop import train

    log.install()  # at the level the parent chose (ADACC_LOG_LEVEL)
    quiet_fallback_warnings()
    args = load_payload(path)
    summary = train(args)
    print(json.dumps({"peak_memory_bytes": summary["peak_memory_bytes"], "extensions": summary["extensions"]},
                     default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
