"""The `adacc` command: train, bench, and the policy tools (profile, solve, show)."""

from __future__ import annotations

import argparse
import importlib
import sys


def _train(argv: list[str]) -> int:
    from megatron_adacc.training.args import add_train_args, parse_train_args
    from megatron_adacc.training.loop import train

    parser = add_train_args(argparse.ArgumentParser(
        prog="adacc train",
        description="Train a megatron-core GPT on the embedded corpus (Python's own documentation, byte "
                    "tokens) with Megatron's DDP and optimizer, and report loss, step time and memory. "
                    "Runs on CPU or CUDA, in one process or under torchrun.",
    ))
    train(parse_train_args(argv, parser))
    return 0


def _bench(argv: list[str]) -> int:
    from megatron_adacc.bench import harness

    names = harness.available_benchmarks()
    parser = argparse.ArgumentParser(prog="adacc bench", description="Run a benchmark: methods side by side, "
                                     "a table with ratios, benchmarks/results/NAME.json (and a PNG).")
    parser.add_argument("name", choices=names)
    first, rest = parser.parse_known_args(argv[:1])
    module = importlib.import_module(f"megatron_adacc.bench.{first.name}")
    sub = argparse.ArgumentParser(prog=f"adacc bench {first.name}", description=module.__doc__)
    sub.add_argument("--quick", action="store_true", help="A CI-sized run (under a minute on 2 cores).")
    sub.add_argument("--output-dir", default=None, help="Where results go (default: benchmarks/results).")
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:] + rest)
    module.run(args)
    return 0


#: Exit status of a refused command line or input (an :class:`~megatron_adacc.core.errors.AdaccError`), argparse's.
EXIT_REFUSED = 2
#: Exit status after Ctrl-C, the shell's convention (128 + SIGINT).
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run one ``adacc`` command. A refusal (:class:`~megatron_adacc.core.errors.AdaccError`) prints its message
    alone, with no traceback, and exits with :data:`EXIT_REFUSED`: it is the user's to fix, not a bug."""
    from megatron_adacc.core.errors import AdaccError

    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except AdaccError as exc:
        print(f"adacc: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt as exc:  # adacc train finished its step (and saved with --save) first
        print(f"adacc: {exc or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _dispatch(argv: list[str]) -> int:
    from megatron_adacc.compat import quiet_fallback_warnings

    quiet_fallback_warnings()
    commands = {"train": _train, "bench": _bench}
    policy_commands = ("profile", "solve", "show")
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: adacc {train,bench,profile,solve,show} ...\n\n"
              "  train    train a megatron-core GPT (see `adacc train --help`)\n"
              "  bench    run a benchmark (see `adacc bench --help`)\n"
              "  profile  profile per-op costs of a transformer layer into the profile database\n"
              "  solve    solve Adacc's MILP for a memory budget and write a policy file\n"
              "  show     print a policy file as a per-op table")
        return 0
    if argv[0] in commands:
        return commands[argv[0]](argv[1:])
    if argv[0] in policy_commands:
        from megatron_adacc import policy_cli

        return policy_cli.main(argv)
    print(f"adacc: unknown command {argv[0]!r}; see `adacc --help`", file=sys.stderr)
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
