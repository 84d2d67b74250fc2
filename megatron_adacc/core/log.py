"""What megatron-adacc says while it works: the package logger, the one handler the front ends install, and
progress bars.

Library code only logs, to ``megatron_adacc`` or a child of it (:func:`get_logger`); it never configures logging,
so a program that imports the package decides what it sees. The front ends do: ``adacc`` (with ``-q``/``-v``),
the Megatron-LM host (with Megatron-LM's ``--logging-level``) and the helper processes they start call
:func:`install`, which gives the package logger one handler on standard error. Its lines read
``[tag] message``, the tag being the logger's name below the package (``megatron_adacc.resireduce`` ->
``[resireduce]``, the package itself ``[adacc]``), with the level before warnings and errors. Under torchrun only
rank 0's lines below ERROR are printed: every rank runs the same command and would say the same.

Progress bars (:func:`progress`, :class:`Steps`) are tqdm's, on standard error, shown only where someone watches:
rank 0, a terminal, and a logger that shows INFO (not ``-q``). Where no bar shows, :class:`Steps` logs one line per
step instead, so a CI log still tells what runs. Results (tables, summaries) go to standard output through
:func:`echo`, which keeps a running bar intact.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

#: The package logger's name; children below it name their tag.
LOGGER = "megatron_adacc"
#: The level a front end chose, handed to the processes it starts (the profiler's child, calibration runs).
LEVEL_ENV = "ADACC_LOG_LEVEL"

_pinned = False  # -q / -v given to `adacc`: a host's own level flag (--logging-level) does not override them


def get_logger(tag: str | None = None) -> logging.Logger:
    """The package logger, or its child ``tag`` (``"resireduce"``, ``"adacc.evolution"``), whose lines start
    ``[resireduce]`` / ``[adacc evolution]``."""
    return logging.getLogger(LOGGER if not tag else f"{LOGGER}.{tag}")


def rank() -> int:
    """This process's rank: torch.distributed's once initialized, else torchrun's ``RANK``, else 0. torch is only
    asked when something imported it already (commands that refuse early must not load it)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def level_of(value: int | str) -> int:
    """A logging level from an int (Megatron-LM's ``--logging-level 20``) or a name (``info``, ``WARNING``)."""
    if isinstance(value, int) or str(value).strip().lstrip("-").isdigit():
        return int(value)
    level = logging.getLevelName(str(value).strip().upper())
    if not isinstance(level, int):
        raise ValueError(f"{value!r} is not a logging level; use a number (10 debug, 20 info, 30 warning, 40 "
                         "error) or one of debug, info, warning, error")
    return level


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        tag = record.name[len(LOGGER) + 1:].replace(".", " ") or "adacc"
        level = f"{record.levelname}: " if record.levelno >= logging.WARNING else ""
        where = f"rank {rank()}: " if rank() else ""  # only errors pass on other ranks; they say whose
        text = f"[{tag}] {where}{level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _Handler(logging.StreamHandler):
    """Standard error as it is at each record (a redirected or captured stream included), rank 0's lines only
    below ERROR, and written above tqdm's running bars rather than through them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_Formatter())
        self.addFilter(lambda record: record.levelno >= logging.ERROR or rank() == 0)

    @property
    def stream(self):  # noqa: D102 - logging.StreamHandler's attribute, looked up at each record
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
            super().emit(record)
            return
        try:
            tqdm.tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own contract: a failing handler reports, never raises
            self.handleError(record)


def install(level: int | str | None = None, *, pin: bool = False) -> logging.Logger:
    """Give the package logger its handler (once) and ``level``: given, else ``$ADACC_LOG_LEVEL`` (a parent's
    choice), else INFO. The level goes to ``$ADACC_LOG_LEVEL`` for the processes this one starts. ``pin``: the
    user's ``-q``/``-v``, which a later level from a host flag (:func:`install` without ``pin``) leaves alone."""
    global _pinned
    logger = get_logger()
    if not any(isinstance(h, _Handler) for h in logger.handlers):
        logger.addHandler(_Handler())
    logger.propagate = False  # a host that configured the root logger (Megatron-LM) would print each line twice
    if _pinned and not pin:
        return logger
    _pinned = _pinned or pin
    try:
        chosen = level_of(level) if level is not None else level_of(os.environ.get(LEVEL_ENV) or logging.INFO)
    except ValueError as exc:
        from megatron_adacc.core.errors import UsageError

        raise UsageError(f"{exc} (${LEVEL_ENV} or the level flag)") from None
    logger.setLevel(chosen)
    os.environ[LEVEL_ENV] = str(chosen)
    return logger


def uninstall() -> None:
    """Undo :func:`install`, the level handed to child processes included (tests: each starts with the
    library's silence)."""
    global _pinned
    logger = get_logger()
    for handler in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    _pinned = False
    os.environ.pop(LEVEL_ENV, None)


def shows_progress() -> bool:
    """Whether bars may show: rank 0 and a logger that prints INFO (a front end installed it, without ``-q``)."""
    return rank() == 0 and get_logger().isEnabledFor(logging.INFO) and any(
        isinstance(h, _Handler) for h in get_logger().handlers)


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str | None = None,
             unit: str = "it", leave: bool = False, **kwargs: Any):
    """A tqdm bar on standard error where :func:`shows_progress` and standard error is a terminal (tqdm's own
    check); elsewhere a disabled one, which iterates and counts without printing."""
    from tqdm import tqdm  # a dependency; imported only where a loop may show a bar

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=leave,
                disable=None if shows_progress() else True, **kwargs)


class Steps:
    """Named steps of a long job (a bench's runs, a sweep's points): a bar that shows the step under way, or,
    where no bar shows, one INFO line per step (``[bench] recompute: megatron_none ...``).

    ``with Steps(3, "recompute") as step: ... step("megatron_none") ...``; ``total`` may be None (unknown)."""

    def __init__(self, total: int | None, desc: str, *, logger: logging.Logger | None = None):
        self.desc = desc
        self.logger = logger or get_logger("bench")
        self.bar = progress(total=total, desc=desc, unit="run")
        self._begun = False

    def __call__(self, label: str) -> None:
        """The step ``label`` begins (the one before it is done)."""
        if self._begun:
            self.bar.update()
        self._begun = True
        self.note(label)

    def note(self, label: str) -> None:
        """What is under way, without counting a step (a step's second part)."""
        if self.bar.disable:
            self.logger.info("%s: %s ...", self.desc, label)
        else:
            self.bar.set_postfix_str(label)

    def iterate(self, items: Iterable[T], label=str) -> Iterator[T]:
        """``items``, each announced as a step (``label(item)``)."""
        for item in items:
            self(label(item))
            yield item

    def close(self) -> None:
        if self._begun and not self.bar.disable:
            self.bar.update()
        self.bar.close()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def echo(text: str = "") -> None:
    """Print a result (a table, a summary) on standard output, above any running bar."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None and getattr(tqdm.tqdm, "_instances", None):
        tqdm.tqdm.write(text, file=sys.stdout)
    else:
        print(text, flush=True)
