"""Exact per-iteration records of a Megatron-LM training run, for bit-identity comparisons.

Megatron logs its reduced ``lm loss`` and gradient norm rounded to a few digits; the end-to-end tests compare
them exactly. :func:`record_iterations` wraps ``megatron.training.training.train_step`` and appends one JSON
line per iteration to ``<path>.rank<R>.jsonl``, the two values as ``float.hex`` strings; :func:`write_report` puts
the features' end-of-run reports beside them (``<path>.rank<R>.report.json``).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from pathlib import Path
from types import ModuleType

#: Environment variable naming the record path (set by the test runner, read by the entry points).
RECORD_ENV = "ADACC_E2E_RECORD"
_MARK = "__adacc_records__"


def record_path() -> str | None:
    """Where this run writes its records: :data:`RECORD_ENV`, except in a measuring child of the run
    (:mod:`megatron_adacc.megatron_lm.host`), which inherits the variable and must not write over them."""
    from megatron_adacc.megatron_lm.host import MEASURE_ENV

    return None if os.environ.get(MEASURE_ENV) else os.environ.get(RECORD_ENV) or None


def record_iterations(training: ModuleType, path: str) -> None:
    """Wrap ``training.train_step`` to record every iteration's loss and gradient norm (once per module, however
    often it is called and whatever wraps ``train_step`` in between)."""
    if getattr(training, _MARK, False):
        return
    setattr(training, _MARK, True)
    original = training.train_step
    signature = inspect.signature(original)  # Megatron's, through the wrappers' __wrapped__
    rank = int(os.environ.get("RANK", "0"))

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        losses, grad_norm = result[0], result[5]
        loss = losses.get("lm loss") if isinstance(losses, dict) else None
        # by name or by position: a feature's wrapper passes Megatron's arguments on positionally
        done = signature.bind(*args, **kwargs).arguments.get("iteration")
        record = {"iteration": int(done or 0) + 1,
                  "loss": float(loss).hex() if loss is not None else None,
                  "grad_norm": float(grad_norm).hex() if grad_norm is not None else None,
                  "skipped": int(result[1])}
        with open(f"{path}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    training.train_step = train_step


def read_records(path: str | Path, rank: int) -> list[dict]:
    """The records one rank wrote, with ``loss`` and ``grad_norm`` as floats (None where the rank has none)."""
    rows = []
    with open(f"{path}.rank{rank}.jsonl") as f:
        for line in f:
            row = json.loads(line)
            for key in ("loss", "grad_norm"):
                row[key] = float.fromhex(row[key]) if row[key] is not None else None
            rows.append(row)
    return rows


def _report_path(path: str | Path, rank: int) -> Path:
    return Path(f"{path}.rank{rank}.report.json")


def write_report(path: str, report: dict) -> None:
    """This rank's features' reports at the end of the run (what ``adacc train`` prints as ``extensions``)."""
    rank = int(os.environ.get("RANK", "0"))
    _report_path(path, rank).write_text(json.dumps(report, default=str) + "\n")


def read_report(path: str | Path, rank: int) -> dict | None:
    """What :func:`write_report` wrote for ``rank``, or None."""
    found = _report_path(path, rank)
    return json.loads(found.read_text()) if found.exists() else None
