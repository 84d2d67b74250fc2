"""Run under torchrun: ``adacc train`` in which rank 1 stops itself (SIGSTOP) before its second step, as a
debugger, a job scheduler or a full swap would stop it. Exits with ``adacc``'s status.

The ranks meet (through files in $FROZEN_RANK_READY_DIR) after their slow imports and before the process
group forms: on two shared cores one rank can import seconds after the other, longer than the test's short
``--distributed-timeout-minutes``, which bounds the group's start-up meeting too.
"""

import os
import signal
import sys
import time
from pathlib import Path

from megatron.core.models.gpt import GPTModel  # noqa: F401  (imported before the ranks meet)

from megatron_adacc import cli
from megatron_adacc.compat import cpu
from megatron_adacc.training import loop

_real_step = loop._train_step


def _train_step(run, iteration, *args, **kwargs):
    if run.rank == 1 and iteration == 2:
        (Path(os.environ["FROZEN_RANK_READY_DIR"]) / "stopped").touch()  # when the test's clock starts
        os.kill(os.getpid(), signal.SIGSTOP)
    return _real_step(run, iteration, *args, **kwargs)


def _meet() -> None:
    ready = Path(os.environ["FROZEN_RANK_READY_DIR"])
    (ready / os.environ["RANK"]).touch()
    while len(list(ready.iterdir())) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)


cpu.apply()
loop._train_step = _train_step
_meet()
code = cli.main(["train", *sys.argv[1:]])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # no interpreter teardown: it would wait on the stopped rank's sockets
