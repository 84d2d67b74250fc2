"""Run every bad-input case of tests/faults/fault_cases.py through the real ``adacc`` CLI and count what went wrong.

    python scripts/fault_sweep.py [--jobs N] [--only SUBSTRING ...] [--ci] [--keep DIR] [--verbose]

The CI suite (tests/faults/test_fault_injection.py) runs one case of each class; this runs the whole table, the
classes issue 22's tester covered. It prints the counts (tracebacks, silent acceptances of invalid input, writes
outside the paths flags name, and refusals that exit otherwise, take more than one line or do not name what is at
fault), one line per failing case, and exits 1 if any count is not zero.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "faults"))

from fault_cases import all_cases  # noqa: E402
from fault_runner import run_cases  # noqa: E402

#: The counts issue 22 asks for first, then the ways a refusal can be badly worded.
KINDS = ("traceback", "accepted", "writes", "exit", "lines", "unnamed")
LABELS = {"traceback": "tracebacks", "accepted": "silent acceptances of invalid input",
          "writes": "writes outside flag-named paths", "exit": "other exit statuses",
          "lines": "not one line on stderr", "unnamed": "line does not name the field/flag/path"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="Cases run at once (default 2).")
    parser.add_argument("--only", nargs="*", default=None, help="Run the cases whose name contains one of these.")
    parser.add_argument("--ci", action="store_true", help="Only the cases the CI suite runs.")
    parser.add_argument("--keep", default=None, metavar="DIR", help="Leave every case's sandbox in DIR.")
    parser.add_argument("--verbose", "-v", action="store_true", help="Print every refusal's line, not only failures'.")
    args = parser.parse_args(argv)
    cases = [c for c in all_cases() if (not args.ci or c.ci)
             and (args.only is None or any(s in c.name for s in args.only))]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="adacc-faults-") as tmp:
        outcomes = run_cases(cases, Path(args.keep or tmp), jobs=args.jobs)
    counts: Counter[str] = Counter()
    for outcome in outcomes:
        problems = outcome.problems()
        counts.update(problems.keys())
        if problems:
            print(f"FAIL {outcome.case.name}: " + "; ".join(f"{k}: {v}" for k, v in problems.items()))
        elif args.verbose:
            print(f"ok   {outcome.case.name}: {outcome.lines[0]}")
    failed = sum(bool(o.problems()) for o in outcomes)
    print(f"\n{len(outcomes)} cases in {time.monotonic() - start:.0f} s, {failed} failed")
    for kind in KINDS:
        print(f"  {counts[kind]:4d}  {LABELS[kind]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
