"""The `adacc` command: train, bench, and the policy tools (profile, solve, show, plan).

Every refusal, from argparse's own to one found deep in training, is an
:class:`~megatron_adacc.core.errors.AdaccError` that :func:`main` alone turns into one line and
:data:`EXIT_REFUSED` (:func:`~megatron_adacc.core.errors.refusal_boundary`); ``--debug`` (anywhere on the command
line) or ``ADACC_DEBUG=1`` shows its traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from megatron_adacc.core.errors import (
    EXIT_INTERRUPTED,
    EXIT_REFUSED,
    ArgumentParser,
    refusal_boundary,
)

__all__ = ["EXIT_INTERRUPTED", "EXIT_REFUSED", "main"]  # the exit statuses, named here for callers


def _train(argv: list[str]) -> int:
    from megatron_adacc.training.args import add_train_args, parse_train_args

    parser = add_train_args(ArgumentParser(
        prog="adacc train",
        description="Train a megatron-core GPT on the embedded corpus (Python's own documentation, byte "
                    "tokens) with Megatron's DDP and optimizer, and report loss, step time and memory. "
                    "Runs on CPU or CUDA, in one process or under torchrun.",
    ))
    args = parse_train_args(argv, parser)
    if args.logging_level is not None:  # Megatron-LM's flag; -q / -v given to `adacc` win over it
        from megatron_adacc.core import log

        log.install(args.logging_level)
    from megatron_adacc.training.loop import train  # after parsing: a refused command line loads no torch

    train(args)
    return 0


def _bench(argv: list[str]) -> int:
    from megatron_adacc.bench import harness

    names = harness.available_benchmarks()
    parser = ArgumentParser(prog="adacc bench", description="Run a benchmark: methods side by side, "
                            "a table with ratios, benchmarks/results/NAME.json (and a PNG).")
    parser.add_argument("name", choices=names)
    first, rest = parser.parse_known_args(argv[:1])
    module = importlib.import_module(f"megatron_adacc.bench.{first.name}")
    sub = ArgumentParser(prog=f"adacc bench {first.name}", description=module.__doc__)
    sub.add_argument("--quick", action="store_true", help="A CI-sized run (under a minute on 2 cores).")
    sub.add_argument("--output-dir", default=None, help="Where results go (default: benchmarks/results).")
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:] + rest)
    module.run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one ``adacc`` command. A refusal (:class:`~megatron_adacc.core.errors.AdaccError`) prints its message
    alone, with no traceback, and exits with :data:`EXIT_REFUSED`: it is the user's to fix, not a bug."""
    return refusal_boundary(_dispatch, list(sys.argv[1:] if argv is None else argv))


COMMANDS = {
    "train": "train a megatron-core GPT (see `adacc train --help`)",
    "bench": "run a benchmark (see `adacc bench --help`)",
    "profile": "profile per-op costs of a transformer layer into the profile database",
    "solve": "solve Adacc's MILP for a memory budget and write a policy file",
    "show": "print a policy file as a per-op table",
    "plan": "plan a model on GPUs without one: per-GPU memory, largest micro-batches, Adacc's policy",
}


def _top_parser() -> ArgumentParser:
    from megatron_adacc import __version__

    commands = "\n".join(f"  {name:<8} {text}" for name, text in COMMANDS.items())
    parser = ArgumentParser(prog="adacc", usage="adacc [-h] [--version] [-q | -v] [--debug] COMMAND ...",
                            description=f"commands:\n{commands}", formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true",
                      help="Warnings and errors only: no status lines, no progress bars (results still print).")
    loud.add_argument("-v", "--verbose", action="store_true", help="Debug lines too.")
    parser.add_argument("command", nargs="?", choices=tuple(COMMANDS), metavar="COMMAND", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _dispatch(argv: list[str]) -> int:
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.core import log

    parser = _top_parser()
    top = parser.parse_args(argv)
    if top.command is None:  # no command is a usage mistake (argparse's status), not a request for help
        parser.print_help(sys.stderr)
        return EXIT_REFUSED
    level = logging.WARNING if top.quiet else logging.DEBUG if top.verbose else None
    log.install(level, pin=level is not None)
    quiet_fallback_warnings()
    commands = {"train": _train, "bench": _bench}
    if top.command in commands:
        return commands[top.command](top.rest)
    from megatron_adacc import policy_cli

    return policy_cli.run([top.command, *top.rest])


if __name__ == "__main__":
    sys.exit(main())
