"""Running a :class:`fault_cases.Case`: the real CLI in a child process, in a sandbox, and what it left behind.

Shared by ``test_fault_injection.py`` and ``scripts/fault_sweep.py``, so that both judge a refusal the same way.
"""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fault_cases import TRAIN, Case
from filelock import FileLock

#: Address-space cap of every child: a case that builds a model by mistake must fail, not take the machine.
CHILD_MEMORY_CAP_GIB = float(os.environ.get("ADACC_FAULT_MEMORY_CAP_GIB", "8"))
CHILD_TIMEOUT_S = 300
#: Flags whose value is a path the command may write; a refusal may leave new files there, and nowhere else.
OUTPUT_FLAGS = ("--save", "--output", "-o", "--output-json", "--output-dir", "--adacc-profile-db")
#: Environment variables a case must not inherit from whoever runs the suite.
SCRUBBED_ENV = ("ADACC_PROFILE_DB", "ADACC_DEBUG", "ADACC_CORPUS_CACHE", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                "XDG_CACHE_HOME", "PYTHONWARNINGS")
#: What others write into the sandbox, not megatron-adacc: torch makes its compile cache's (empty) folder in
#: $TMPDIR whenever megatron-core imports torch._dynamo.
NOT_OURS = ("tmp/torchinductor_",)


class Shared:
    """Inputs several cases derive theirs from, made once: a real checkpoint of ``fault_cases.SMALL``. Test
    workers of one run may share ``root``: a file lock lets the first make it and the others wait for it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()  # the sweep's threads; the file lock is per process

    def checkpoint(self) -> Path:
        directory = self.root / "checkpoint"
        with self._lock, FileLock(str(self.root / ".lock")):
            if not (directory / "rank00000.json").exists():  # the manifest is written last
                out = cli(list(TRAIN) + ["--save", str(directory)], self.root, child_env(self.root))
                assert out.returncode == 0, out.stderr[-2000:]
        return directory


def child_env(sandbox: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the sandbox's ``$HOME`` and ``$TMPDIR``, so that default outputs land inside it."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    for name in ("home", "tmp"):
        (sandbox / name).mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(sandbox / "home"), TMPDIR=str(sandbox / "tmp"), OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    env.update(extra or {})
    return env


def _cap_memory() -> None:
    cap = int(CHILD_MEMORY_CAP_GIB * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def cli(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_adacc.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, errors="replace", timeout=CHILD_TIMEOUT_S,
                          preexec_fn=_cap_memory)


def snapshot(root: Path) -> dict[str, str]:
    """Every path under the sandbox ``root`` with what it is: a folder, or a file's SHA-256 and modification
    time (but :data:`NOT_OURS`)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if str(path.relative_to(root)).startswith(NOT_OURS):
            continue
        if path.is_dir() and not path.is_symlink():
            found[str(path)] = "dir"
        elif path.is_file():
            found[str(path)] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {path.stat().st_mtime_ns}"
        else:
            found[str(path)] = "other"
    return found


def _allowed(argv: list[str], env: dict[str, str]) -> list[str]:
    paths = [argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag in OUTPUT_FLAGS]
    paths += [env["ADACC_PROFILE_DB"]] if "ADACC_PROFILE_DB" in env else []
    return [str(Path(p).resolve()) for p in paths if p]


def unexpected_writes(before: dict[str, str], after: dict[str, str], allowed: list[str]) -> list[str]:
    """Paths that changed, except new ones under an allowed path: a file that was there must stay as it was."""
    changed = [p for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)]
    under = lambda p: any(p == a or p.startswith(a + os.sep) for a in allowed)  # noqa: E731
    return [p for p in changed if p in before or not under(str(Path(p).resolve()))]


@dataclass
class Outcome:
    case: Case
    returncode: int
    stdout: str
    stderr: str
    writes: list[str]

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    def problems(self) -> dict[str, str]:
        """What is wrong with this refusal, by kind: ``traceback``, ``accepted`` (exit 0 on invalid input),
        ``writes`` (outside flag-named paths), ``exit`` (another status), ``lines`` (not one line on stderr),
        ``unnamed`` (the line does not name the field, flag or path)."""
        found = {}
        if "Traceback" in self.stderr or "Traceback" in self.stdout:
            found["traceback"] = self.lines[-1][:300] if self.lines else "?"
        if self.returncode == 0:
            found["accepted"] = "exit 0"
        elif self.returncode != self.case.exit:
            found["exit"] = f"exit {self.returncode}, expected {self.case.exit}"
        if self.writes:
            found["writes"] = ", ".join(self.writes[:3]) + (" ..." if len(self.writes) > 3 else "")
        if self.returncode != 0 and len(self.lines) != 1:
            found["lines"] = f"{len(self.lines)} lines on stderr: " + " | ".join(self.lines[:2])[:300]
        elif self.returncode != 0 and self.case.names not in self.lines[0]:
            found["unnamed"] = f"does not name {self.case.names!r}: {self.lines[0][:300]}"
        return found


def run_case(case: Case, sandbox: Path, shared: Shared) -> Outcome:
    """Run ``case`` in a fresh ``sandbox`` (created here) and collect what it did."""
    folder, cwd = sandbox / "in", sandbox / "cwd"
    folder.mkdir(parents=True)
    cwd.mkdir()
    if case.setup is not None:
        case.setup(folder, shared)
    fill = lambda s: s.replace("{in}", str(folder))  # noqa: E731
    argv = [fill(a) for a in case.argv]
    env = child_env(sandbox, {k: fill(v) for k, v in case.env.items()})
    before = snapshot(sandbox)
    proc = cli(argv, cwd, env)
    writes = unexpected_writes(before, snapshot(sandbox), _allowed(argv, env))
    return Outcome(case, proc.returncode, proc.stdout, proc.stderr, [os.path.relpath(p, sandbox) for p in writes])


def run_cases(cases: list[Case], root: Path, jobs: int = 2) -> list[Outcome]:
    """Every case in its own sandbox under ``root``, ``jobs`` at a time; outcomes in the cases' order."""
    shared = Shared(root / "_shared")
    shared.root.mkdir(parents=True, exist_ok=True)
    sandbox = lambda i: root / f"{i:03d}"  # noqa: E731
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda ic: run_case(ic[1], sandbox(ic[0]), shared), enumerate(cases)))
