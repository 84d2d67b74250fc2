"""One base class for every refusal megatron-adacc makes, and the one boundary that prints them.

A refusal is something the user can fix: a wrong policy file, an impossible budget, a flag combination that
cannot work. Its message is one line (or a short list) naming the problem and the fix. Library code only
raises; the command-line front ends (``adacc ...`` through :func:`refusal_boundary`, and the Megatron-LM patch)
decide how to exit, so the same error is an exception for a Python caller and one clear line, with no traceback,
for a user.

Subclasses keep the builtin base they had (``ValueError``, ``ImportError`` ...) so ``except ValueError`` in
callers written before this class existed still catches them.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

#: Exit status of a refused command line or input (an :class:`AdaccError`), argparse's.
EXIT_REFUSED = 2
#: Exit status after Ctrl-C, the shell's convention (128 + SIGINT).
EXIT_INTERRUPTED = 130
#: What a filter whose reader stopped reading exits with (128 + SIGPIPE), as `cat` or `grep` would.
EXIT_BROKEN_PIPE = 141
#: ``ADACC_DEBUG=1`` is ``--debug`` for every adacc command of a session or a job script.
DEBUG_ENV = "ADACC_DEBUG"
DEBUG_FLAG = "--debug"
DEBUG_HELP = (f"{DEBUG_FLAG} (anywhere on the command line) or {DEBUG_ENV}=1: show a refusal's full traceback "
              "instead of its one line.")


class AdaccError(Exception):
    """A problem with the user's input or setup that megatron-adacc can explain, and the fix for it."""

    every_rank = False
    """Whether each rank that raises it says so (prefixed with its rank), rather than rank 0 for all: for a
    refusal one rank may meet alone (a rank that stopped answering, which may be rank 0 itself)."""


class IntegrationError(AdaccError, ValueError):
    """A megatron-adacc flag cannot work with the rest of the command line."""


class FeatureUnavailable(AdaccError, ImportError):
    """A flag asks for a feature whose module this installation of megatron-adacc cannot import."""


class PatchTargetMissing(AdaccError, RuntimeError):
    """A function megatron-adacc wraps does not exist in the installed Megatron (or torch)."""


class InputNotFound(AdaccError, FileNotFoundError):
    """A file the command line names (a policy, a config, a checkpoint) is not there."""


class UsageError(AdaccError, ValueError):
    """A command line that does not parse: an unknown flag or command, a missing or malformed value."""


class OutputNotWritable(AdaccError, OSError):
    """A file megatron-adacc was asked to write cannot be written there (a folder in the way, no space ...)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are refusals like any other: one line through :func:`refusal_boundary`
    that names the flag, instead of argparse's usage block (dozens of lines for ``adacc train``) and its exit."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("epilog", DEBUG_HELP)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def refusal_boundary(command: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run ``command(argv)`` (``--debug`` taken out) as a command-line program: a refusal prints one line and
    gives :data:`EXIT_REFUSED`, Ctrl-C :data:`EXIT_INTERRUPTED`; anything else is a bug and keeps its traceback."""
    debug = debug_asked(argv)
    try:
        return command([a for a in argv if a != DEBUG_FLAG])
    except AdaccError as exc:
        _refuse(exc, debug)
        return EXIT_REFUSED
    except KeyboardInterrupt as exc:  # adacc train finished its step (and saved with --save) first
        print(f"adacc: {exc or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `adacc show p.json | head`: the reader has all it wanted; as for any Unix filter
        # Python would report the failed flush of stdout at exit; point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def debug_asked(argv: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether the user asked for tracebacks: :data:`DEBUG_FLAG` on the command line or :data:`DEBUG_ENV` set."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def refusal_line(exc: AdaccError, prefix: str, rank: int) -> str | None:
    """What ``rank`` prints for ``exc``, or None. Under torchrun every rank parses the same command line and
    checks the same inputs, so every rank would print the same refusal: rank 0 speaks for all. A refusal one rank
    may meet alone (:attr:`AdaccError.every_rank`) is said by each rank that meets it, with its rank."""
    if rank == 0:
        return f"{prefix}: {one_line(exc)}"
    return f"{prefix}: rank {rank}: {one_line(exc)}" if exc.every_rank else None


def _refuse(exc: AdaccError, debug: bool) -> None:
    """One line per :func:`refusal_line`; a traceback is asked for to debug one rank: every rank shows its own."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
        return
    line = refusal_line(exc, "adacc", int(os.environ.get("RANK", "0") or 0))
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    """A refusal's message on one line: a message that lists its problems ("cannot run this command line:" then
    one "- ..." line each) keeps its head and joins the items, so that the whole refusal stays one line that a
    log or a CI summary shows in full."""
    head, *items = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    items = [item[2:] if item.startswith("- ") else item for item in items]
    return head if not items else f"{head}{' ' if head.endswith(':') else '; '}{'; '.join(items)}"
