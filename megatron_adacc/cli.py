"""The `adacc` command: train, bench, and the policy tools (profile, solve, show).

Every refusal, from argparse's own to one found deep in training, is an
:class:`~megatron_adacc.core.errors.AdaccError` that :func:`main` alone turns into one line and
:data:`EXIT_REFUSED` (:func:`~megatron_adacc.core.errors.refusal_boundary`); ``--debug`` (anywhere on the command
line) or ``ADACC_DEBUG=1`` shows its traceback instead.
"""

from __future__ import annotations

import importlib
import sys

from megatron_adacc.core.errors import (
    DEBUG_HELP,
    EXIT_INTERRUPTED,
    EXIT_REFUSED,
    ArgumentParser,
    UsageError,
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


def _dispatch(argv: list[str]) -> int:
    from megatron_adacc.compat import quiet_fallback_warnings

    quiet_fallback_warnings()
    commands = {"train": _train, "bench": _bench}
    policy_commands = ("profile", "solve", "show")
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: adacc [--debug] {train,bench,profile,solve,show} ...\n\n"
              "  train    train a megatron-core GPT (see `adacc train --help`)\n"
              "  bench    run a benchmark (see `adacc bench --help`)\n"
              "  profile  profile per-op costs of a transformer layer into the profile database\n"
              "  solve    solve Adacc's MILP for a memory budget and write a policy file\n"
              "  show     print a policy file as a per-op table\n\n" + DEBUG_HELP)
        return 0
    if argv[0] in commands:
        return commands[argv[0]](argv[1:])
    if argv[0] in policy_commands:
        from megatron_adacc import policy_cli

        return policy_cli.run(argv)
    raise UsageError(f"unknown command {argv[0]!r}; the commands are train, bench, profile, solve and show "
                     "(see `adacc --help`)")


if __name__ == "__main__":
    sys.exit(main())
