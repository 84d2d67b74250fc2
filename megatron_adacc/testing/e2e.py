"""The end-to-end matrix: Megatron-LM's training loop with and without megatron-adacc, compared bit for bit.

    python -m megatron_adacc.testing.e2e --checkout PATCHED --unpatched UNPATCHED [--out FILE.md] [CASE...]
    python -m megatron_adacc.testing.e2e [--out FILE.md] [CASE...]        # megatron-core's megatron.training

One :class:`Case` is one training run (10 iterations of a 2-layer GPT on mock data, the command line of
:data:`SMALL_GPT`). Each plugin case names the stock case it must reproduce: bit for bit (every iteration's
loss and gradient norm, as ``float.hex``) where the math is exact, within a bound where it is lossy. Two
launchers run the same cases:

* :class:`EntryPoint`: this project's :mod:`megatron_adacc.testing.pretrain_gpt` over megatron-core's
  ``megatron.training`` (the CI tier; ``--stock`` is the unpatched reference);
* :class:`Checkout`: a Megatron-LM checkout's own ``pretrain_gpt.py``, patched and unpatched (the developer
  tier, ``scripts/megatron_lm_cpu_e2e.sh``).

Without a GPU, both run under :mod:`megatron_adacc.testing.megatron_lm_cpu`. Every rank's address space is
capped (:data:`RANK_MEMORY_CAP_GIB`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_adacc.comm.options import SCHEMES
from megatron_adacc.compat.process import free_port
from megatron_adacc.models import SDPA_SPEC_FLAG
from megatron_adacc.testing.records import RECORD_ENV, read_records, read_report

#: A 2-layer GPT, mock data, 2 micro-batches per step, no apex (the flags an apex-less image needs).
SMALL_GPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-decay-style constant --min-lr 1e-3 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --transformer-impl local "
    "--distributed-backend gloo --log-interval 1 --eval-iters 0 --eval-interval 1000 --seed 1234 "
    "--no-gradient-accumulation-fusion --no-persist-layer-norm"
).split()
ITERATIONS = 10
#: RLIMIT_AS of every rank. A rank of the CUDA torch wheel reserves ~6 GiB of address space it never touches.
RANK_MEMORY_CAP_GIB = float(os.environ.get("ADACC_E2E_RANK_CAP_GIB", "24"))


@dataclass(frozen=True)
class Case:
    """One training run and what it must reproduce."""

    name: str
    flags: tuple[str, ...] = ()
    nproc: int = 1
    stock: bool = False
    """Run without megatron-adacc (the unpatched script)."""
    reference: str | None = None
    """The case whose records this one must match."""
    loss_tolerance: float = 0.0
    """0: bit-identical losses and gradient norms. Otherwise the largest allowed |loss - reference loss|."""
    trains: bool = False
    """No reference: every loss is finite and the last is below the first (lossy gradient communication)."""
    iterations: int = ITERATIONS
    resume_at: int | None = None
    """Load the checkpoint that the reference's straight run saved at this iteration and train to the end: the
    second half of a save and resume, whose first half is the reference itself (one launch, not two)."""
    budget_from: str | None = None
    """For ``auto``: the case whose budget probe this one reuses (default: its own)."""
    profile_db: str = "profile"
    """``--adacc-profile-db`` (a file of the work folder): cases that name the same one share profiles."""
    fresh_profile: bool = False
    """Empty the profile database first: ``auto`` profiles (cold cache)."""
    calibrated: bool = False
    """For ``auto``: no pinned process baseline. ``auto`` calibrates the process memory with measuring children
    of the run's own command (megatron_lm.host), under the low-fragmentation allocator, and the budget is placed
    above the smallest one that leaves: the measured peak is then checked against it."""
    on_demand: bool = False
    """Run only when named (``ADACC_E2E_CASES``, the command line): too heavy for CI's 2 cores (4 ranks), or
    what a case in CI already covers."""

    @property
    def recorded(self) -> int:
        """The iterations this case's launch trains and records (a resumed one: those after ``resume_at``)."""
        return self.iterations - (self.resume_at or 0)


#: ``--resireduce`` schemes: every one the comm feature offers.
RESIREDUCE_SCHEMES = tuple(s for s in SCHEMES if s != "none")
#: The schemes whose resume CI runs (the others on demand).
RESUMED_IN_CI = ("residual", "w+2d")
#: QSGD, whose owners quantize the sum again at any number of ranks (top-k's keep all of 2 ranks' entries).
RESIREDUCE_RS = ("--resireduce", "residual", "--grad-compressor", "qsgd", "--resireduce-transport", "reduce-scatter")
#: AdamA never holds the mini-batch gradient, so Megatron's global clipping is off (``--clip-grad 0``).
ADAMA = ("--adama", "--clip-grad", "0", "--ckpt-format", "torch")
#: AdamA sharded like Megatron's distributed optimizer, clipping each micro-batch's gradient by its global norm
#: (buckets well below the model, as a real run's are), 6 iterations: CI's time is tight.
ADAMA_DO = ("--adama", "--use-distributed-optimizer", "--clip-grad", "1.0", "--ddp-bucket-size", "8000",
            "--ckpt-format", "torch")
AUTO = ("--adacc-policy", "auto")
#: ``auto`` in runs compared bit for bit: evolution switches on outlier statistics alone (codec times re-measured
#: during training differ from run to run, and a switch they decide would differ with them).
AUTO_DETERMINISTIC = (*AUTO, "--deterministic-mode")
#: Megatron's full activation recompute, every layer: what ``--adacc-policy recompute`` must equal bit for bit.
MEGATRON_FULL_RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1")
#: GACT's adaptive bits, re-allocated every 2 iterations so that a resumed run depends on the saved widths.
GACT = ("--gact-level", "L2", "--gact-adapt-interval", "2")
#: PyTorch's SDPA attention, through Megatron-LM's own ``--spec`` (its local layer ignores --attention-backend),
#: without attention dropout, which the CPU kernel lacks.
SDPA = (*SDPA_SPEC_FLAG, "--attention-dropout", "0")


def _is_auto(c: Case) -> bool:
    return any(a == "--adacc-policy" and b == "auto" for a, b in zip(c.flags, c.flags[1:]))


def _parallel(tp: int = 1, pp: int = 1) -> tuple[str, ...]:
    return ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp))


def tensor_parallel(c: Case) -> int:
    """The case's tensor-parallel size."""
    flags = list(c.flags)
    return int(flags[flags.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in flags else 1


#: The matrix. ``stock*`` are the references; ``auto-*`` budgets are placed by :func:`auto_budget_flags`.
CASES: tuple[Case, ...] = (
    Case("stock", stock=True),
    Case("none", ("--adacc-policy", "none"), reference="stock"),
    Case("keep", ("--adacc-policy", "keep"), reference="stock"),
    Case("recompute", ("--adacc-policy", "recompute"), reference="stock"),
    Case("auto-lossless", ("--adacc-policy", "auto", "--adacc-codec", "none"), reference="stock"),
    Case("auto-int4", AUTO_DETERMINISTIC, reference="stock", loss_tolerance=0.05),
    Case("stock-dp2", nproc=2, stock=True),
    Case("none-dp2", ("--adacc-policy", "none"), nproc=2, reference="stock-dp2"),
    Case("recompute-dp2", ("--adacc-policy", "recompute"), nproc=2, reference="stock-dp2"),
    Case("stock-tp2", _parallel(tp=2), nproc=2, stock=True),
    # Megatron's own full recompute, the reference of Adacc's recompute preset at the same layout.
    Case("megatron-recompute-tp2", (*_parallel(tp=2), *MEGATRON_FULL_RECOMPUTE), nproc=2, stock=True),
    Case("recompute-tp2", (*_parallel(tp=2), "--adacc-policy", "recompute"), nproc=2,
         reference="megatron-recompute-tp2"),
    Case("keep-tp2", (*_parallel(tp=2), "--adacc-policy", "keep"), nproc=2, reference="stock-tp2"),
    Case("quantize-tp2", (*_parallel(tp=2), "--adacc-policy", "quantize-all"), nproc=2, reference="stock-tp2",
         loss_tolerance=0.05),
    Case("stock-pp2", _parallel(pp=2), nproc=2, stock=True),
    Case("megatron-recompute-pp2", (*_parallel(pp=2), *MEGATRON_FULL_RECOMPUTE), nproc=2, stock=True),
    Case("recompute-pp2", (*_parallel(pp=2), "--adacc-policy", "recompute"), nproc=2,
         reference="megatron-recompute-pp2"),
    # The custom checkpoint on every stage, keeping all: no arithmetic changes, so bit-identical to stock-pp2.
    Case("keep-pp2", (*_parallel(pp=2), "--adacc-policy", "keep"), nproc=2, reference="stock-pp2"),
    # Each stage solves for its own layers and the micro-batches it holds in flight (stage 0: both of a step).
    Case("auto-pp2", (*_parallel(pp=2), *AUTO), nproc=2, reference="stock-pp2", loss_tolerance=0.05),
    # Untied: the word embeddings' gradient is whole on one stage when AdamA folds it.
    Case("adama-pp2", (*_parallel(pp=2), *ADAMA, "--untie-embeddings-and-output-weights"), nproc=2, trains=True),
    # ResiReduce per tensor-parallel shard: each TP rank's data-parallel group reduces its own. Keeping every entry
    # (density 1), its sum over 2 ranks is Megatron's all-reduce bit for bit.
    Case("stock-tp2dp2", _parallel(tp=2), nproc=4, stock=True, on_demand=True),
    Case("resireduce-dense-tp2dp2", (*_parallel(tp=2), "--resireduce", "residual", "--grad-compress-density", "1.0"),
         nproc=4, reference="stock-tp2dp2", on_demand=True),
    Case("resireduce-tp2dp2", (*_parallel(tp=2), "--resireduce", "residual"), nproc=4, trains=True, on_demand=True),
    Case("stock-pp2dp2", _parallel(pp=2), nproc=4, stock=True, on_demand=True),
    Case("resireduce-dense-pp2dp2", (*_parallel(pp=2), "--resireduce", "residual", "--grad-compress-density", "1.0"),
         nproc=4, reference="stock-pp2dp2", on_demand=True),
    # Resuming: 5 iterations, save, exit; load, 5 more == 10 straight, bit for bit.
    Case("stock-resume", stock=True, resume_at=5, reference="stock"),
    Case("auto-int4-resume", AUTO_DETERMINISTIC, resume_at=5, reference="auto-int4", budget_from="auto-int4"),
    *(Case(f"resireduce-{scheme}", ("--resireduce", scheme), nproc=2, trains=True) for scheme in RESIREDUCE_SCHEMES),
    # Residuals are saved and restored per group whatever the scheme's similarity measure; CI resumes the scheme
    # without sharing and the one sharing by two measures at once (CI's time is tight: ~1 min per resume).
    *(Case(f"resireduce-{scheme}-resume", ("--resireduce", scheme), nproc=2, resume_at=5,
           reference=f"resireduce-{scheme}", on_demand=scheme not in RESUMED_IN_CI) for scheme in RESIREDUCE_SCHEMES),
    # The compressed reduce-scatter, whose owners keep residuals of their own in the checkpoint.
    Case("resireduce-reduce-scatter", RESIREDUCE_RS, nproc=2, trains=True),
    Case("resireduce-reduce-scatter-resume", RESIREDUCE_RS, nproc=2, resume_at=5,
         reference="resireduce-reduce-scatter"),
    # Profiling in a child process leaves this run's memory and random streams alone: a first run with an empty
    # profile database equals the next run, which reuses its profile.
    Case("auto-cold", AUTO_DETERMINISTIC, budget_from="auto-int4", profile_db="cold", fresh_profile=True, trains=True),
    Case("auto-warm", AUTO_DETERMINISTIC, budget_from="auto-int4", profile_db="cold", reference="auto-cold"),
    # The budget a user gives is the one the run keeps: peak RSS, the process memory calibrated by the run.
    Case("auto-budget", AUTO, profile_db="calibrated", fresh_profile=True, calibrated=True, trains=True,
         iterations=6),
    Case("auto-budget-pp2", (*_parallel(pp=2), *AUTO), nproc=2, profile_db="calibrated-pp2", fresh_profile=True,
         calibrated=True, trains=True, iterations=6),
    Case("adama", ADAMA, trains=True),
    Case("adama-resume", ADAMA, resume_at=5, reference="adama"),
    Case("adama-do-dp2", ADAMA_DO, nproc=2, trains=True, iterations=6),
    Case("adama-do-dp2-resume", ADAMA_DO, nproc=2, iterations=6, resume_at=3, reference="adama-do-dp2"),
    Case("gact", GACT, trains=True),
    Case("gact-resume", GACT, resume_at=5, reference="gact"),
    # The SDPA layer: stock Megatron-LM and Adacc on the same attention.
    Case("stock-sdpa", SDPA, stock=True),
    Case("keep-sdpa", (*SDPA, "--adacc-policy", "keep"), reference="stock-sdpa"),
    Case("recompute-sdpa", (*SDPA, "--adacc-policy", "recompute"), reference="stock-sdpa"),
)


def case(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}; known: {', '.join(c.name for c in CASES)}")


#: What runs when no case is named (CI's matrix): every case but the on-demand ones.
CI_CASES: tuple[Case, ...] = tuple(c for c in CASES if not c.on_demand)


# ---------------------------------------------------------------------------------------------- launchers


def _versions(python: str) -> str:
    found = subprocess.run([python, "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__)"],
                           capture_output=True, text=True).stdout.split()
    ours = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
                          capture_output=True, text=True).stdout.strip() or "unknown"
    python_torch = f"Python {found[0]}, torch {found[1]}" if len(found) == 2 else "versions unknown"
    return f"{python_torch}, megatron-adacc {ours}"


@dataclass(frozen=True)
class EntryPoint:
    """megatron-core's ``megatron.training`` driven by :mod:`megatron_adacc.testing.pretrain_gpt`."""

    python: str = sys.executable

    def command(self, c: Case) -> list[str]:
        return ["-m", "megatron_adacc.testing.pretrain_gpt", *(["--stock"] if c.stock else [])]

    def env(self, c: Case) -> dict[str, str]:
        return {}

    def describe(self) -> str:
        import importlib.metadata

        return f"megatron-core {importlib.metadata.version('megatron-core')} megatron.training, " \
               f"megatron_adacc.testing.pretrain_gpt; {_versions(self.python)}"


@dataclass(frozen=True)
class Checkout:
    """A Megatron-LM checkout's ``pretrain_gpt.py``: ``patched`` for plugin cases, ``unpatched`` for stock."""

    patched: Path
    unpatched: Path
    python: str = sys.executable

    def command(self, c: Case) -> list[str]:
        root = self.unpatched if c.stock else self.patched
        return ["-m", "megatron_adacc.testing.megatron_lm_cpu", str(root / "pretrain_gpt.py")]

    def env(self, c: Case) -> dict[str, str]:
        # The checkout's megatron/ before any installed megatron-core, in the ranks and in the processes they
        # start (Adacc's profiler child); this repository next.
        root = self.unpatched if c.stock else self.patched
        return {"PYTHONPATH": os.pathsep.join([str(root), str(Path(__file__).resolve().parents[2])])}

    def describe(self) -> str:
        commit = subprocess.run(["git", "-C", str(self.unpatched), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown commit"
        return (f"Megatron-LM checkout {commit}, pretrain_gpt.py patched by scripts/apply_patches.sh; "
                f"{_versions(self.python)}")


# ------------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    case: Case
    returncode: int
    wall_s: float
    records: list[dict] = field(default_factory=list)
    output: str = ""
    reports: dict[int, dict] = field(default_factory=dict)
    """Each rank's features' reports at the end of the run (the last launch of a resumed case)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and len(self.records) == self.case.recorded


def _cap_address_space() -> None:
    limit = int(RANK_MEMORY_CAP_GIB * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def run_case(c: Case, launcher: EntryPoint | Checkout, workdir: Path, *, extra: Sequence[str] = (),
             timeout: float = 600, save_at: int | None = None) -> Run:
    """Train ``c`` under ``launcher``, saving a checkpoint every ``save_at`` iterations (for the cases that resume
    from it); a resume case loads its reference's (:func:`resume_point`). Records come from the last rank (the
    last pipeline stage)."""
    workdir.mkdir(parents=True, exist_ok=True)
    record = workdir / c.name
    for old in [*workdir.glob(f"{c.name}.rank*.jsonl"), *workdir.glob(f"{c.name}.rank*.report.json")]:
        old.unlink()
    flags = [*SMALL_GPT, "--train-iters", str(c.iterations), *c.flags, *extra]
    if not c.stock and _adacc_on(flags):  # a flag of a feature left off is refused
        db = workdir / f"{c.profile_db}.sqlite"
        if c.fresh_profile:
            db.unlink(missing_ok=True)
        flags += ["--adacc-profile-db", str(db)]
    checkpoints = checkpoint_folder(workdir, c.name)
    shutil.rmtree(checkpoints, ignore_errors=True)
    if save_at is not None:
        flags += ["--save", str(checkpoints), "--save-interval", str(save_at)]
    if c.resume_at is None:
        run = _launch(c, launcher, workdir, flags, timeout)
    elif (point := resume_point(c, workdir)) is None:
        run = Run(c, 1, 0.0, output=f"{c.reference} saved no checkpoint at iteration {c.resume_at}: nothing to resume")
    else:
        run = _launch(c, launcher, workdir, [*flags, "--load", str(point)], timeout)
    (workdir / f"{c.name}.log").write_text(run.output)
    last = c.nproc - 1
    if Path(f"{record}.rank{last}.jsonl").exists():
        run.records = read_records(record, last)
    run.reports = {rank: report for rank in range(c.nproc) if (report := read_report(record, rank)) is not None}
    return run


def checkpoint_folder(workdir: Path, name: str) -> Path:
    """Where the case ``name`` saves (``--save``) or, resumed, loads its checkpoints."""
    return workdir / f"{name}.checkpoints"


def resume_point(c: Case, workdir: Path) -> Path | None:
    """A checkpoint folder of ``c``'s own holding the iteration its reference saved at ``c.resume_at`` (linked,
    not copied) as its latest, so that Megatron loads that one and not the reference's last; None if there is
    none. The reference saved it without stopping, so a save that changed the state its run goes on with, rather
    than only what it wrote, shows as a difference."""
    tag = f"iter_{c.resume_at:07d}"
    saved = checkpoint_folder(workdir, c.reference) / tag
    if not saved.is_dir():
        return None
    folder = checkpoint_folder(workdir, c.name)
    shutil.copytree(saved, folder / tag, copy_function=os.link)
    (folder / "latest_checkpointed_iteration.txt").write_text(str(c.resume_at))
    return folder


def _launch(c: Case, launcher: EntryPoint | Checkout, workdir: Path, flags: list[str], timeout: float) -> Run:
    record = workdir / c.name
    cmd = [launcher.python, "-m", "torch.distributed.run", f"--nproc_per_node={c.nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *launcher.command(c), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", RECORD_ENV: str(record), "PYTHONWARNINGS": "ignore",
           "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron asserts it under TP, as its example scripts set it
           **({"MALLOC_MMAP_THRESHOLD_": "65536"} if c.calibrated else {}),  # docs/measuring.md
           **launcher.env(c)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          preexec_fn=_cap_address_space)
    return Run(c, proc.returncode, time.perf_counter() - start, output=proc.stdout + proc.stderr)


_INFEASIBLE = re.compile(r"smallest feasible budget is ([\d,]+) bytes")


_BUDGETS: dict[tuple, list[str]] = {}


def auto_budget_flags(c: Case, launcher: EntryPoint | Checkout, workdir: Path) -> list[str]:
    """A budget inside the window where ``auto`` mixes its actions.

    The process baseline is pinned (1 MiB) so that the budget covers the model only, unless the case is
    ``calibrated`` (then the probe calibrates it as a user's run does); a first run under a 1 MiB budget is
    refused by the solver, naming the smallest feasible budget (everything recomputed); the case then gets
    2 MiB more than that, between it and keeping everything (~5 MiB of activations here).
    """
    source = case(c.budget_from) if c.budget_from else c
    key = (source.flags, source.nproc, source.calibrated, launcher)
    if key not in _BUDGETS:
        _BUDGETS[key] = _probe_budget(source, launcher, workdir)
    return _BUDGETS[key]


def _adacc_on(flags: list[str]) -> bool:
    """Whether ``flags`` turn Adacc on (the last ``--adacc-policy`` is not ``none``)."""
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--adacc-policy"]
    return bool(values) and values[-1] != "none"


def _probe_budget(c: Case, launcher: EntryPoint | Checkout, workdir: Path) -> list[str]:
    pinned = [] if c.calibrated else ["--adacc-process-baseline", "1MiB"]
    # as long as the case: the probe is refused before it trains, and a calibration it runs lasts the run's steps
    probe = run_case(Case(f"{c.name}-probe", c.flags, c.nproc, iterations=c.iterations, profile_db=c.profile_db,
                          fresh_profile=c.fresh_profile, calibrated=c.calibrated), launcher, workdir,
                     extra=[*pinned, "--adacc-memory-budget", "1MiB"])
    found = _INFEASIBLE.search(probe.output)
    if found is None:
        raise RuntimeError(f"{c.name}: the 1 MiB probe was not refused with the smallest feasible budget:\n"
                           f"{probe.output[-3000:]}")
    floor = int(found.group(1).replace(",", ""))
    return [*pinned, "--adacc-memory-budget", str(floor + 2 * 2**20)]


@dataclass
class Comparison:
    identical: bool
    max_loss_diff: float
    within: bool
    note: str = ""


def compare(run: Run, reference: Run) -> Comparison:
    """``run`` against ``reference``, iteration by iteration."""
    if not run.ok or not reference.ok:
        failed = run if not run.ok else reference
        return Comparison(False, float("nan"), False, f"{failed.case.name} failed (exit {failed.returncode}, "
                                                       f"{len(failed.records)} iterations recorded)")
    by_iteration = {r["iteration"]: r for r in reference.records}
    if any(r["iteration"] not in by_iteration for r in run.records):
        return Comparison(False, float("nan"), False, f"iterations the reference did not record: "
                                                       f"{[r['iteration'] for r in run.records]}")
    pairs = [(r, by_iteration[r["iteration"]]) for r in run.records]
    identical = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in pairs)
    diff = max(abs(a["loss"] - b["loss"]) for a, b in pairs)
    return Comparison(identical, diff, identical or diff <= run.case.loss_tolerance)


# ----------------------------------------------------------------------------------------------- matrix


def run_matrix(cases: Sequence[Case], launcher: EntryPoint | Checkout, workdir: Path,
               log=lambda message: print(message, file=sys.stderr, flush=True), *,
               slots: int | None = None) -> dict[str, Run]:
    """Run ``cases`` and the references they name, each once, side by side where they fit in ``slots`` ranks
    (default :data:`MATRIX_SLOTS_ENV`, else the machine's cores), returned in their order.

    Ranks run one thread each, and most of a small case's wall time is its start (importing torch and Megatron
    on one core): two one-rank cases together take about as long as one. Cases that touch the same profile
    database, their own or their budget probe's, run one after the other in the order named: ``auto-warm`` reads
    what ``auto-cold`` profiled, and a resumed ``auto`` case must solve from the profile its straight run did. A
    resumed case also waits for its reference, which saves the checkpoint it starts from."""
    wanted: list[str] = []

    def want(c: Case) -> None:  # references first, transitively
        if c.reference:
            want(case(c.reference))
        if c.name not in wanted:
            wanted.append(c.name)

    for c in cases:
        want(c)
    slots = max(1, slots or int(os.environ.get(MATRIX_SLOTS_ENV) or os.cpu_count() or 1))
    pending = [case(name) for name in wanted]
    # a resumed case starts from its reference's checkpoint, which the reference saves on its way
    save_at = {c.reference: c.resume_at for c in pending if c.resume_at is not None}
    databases = {c.name: _databases(c) for c in pending}
    need = {c.name: min(c.nproc, slots) for c in pending}
    runs: dict[str, Run] = {}
    running: dict[concurrent.futures.Future, Case] = {}
    free = slots

    def run(c: Case) -> Run:
        extra = auto_budget_flags(c, launcher, workdir) if _is_auto(c) else []
        return run_case(c, launcher, workdir, extra=extra, save_at=save_at.get(c.name))

    with concurrent.futures.ThreadPoolExecutor(max_workers=slots) as pool:
        while pending or running:
            for c in list(pending):  # in order: a case waits for those before it on its databases
                earlier = [*running.values(), *pending[:pending.index(c)]]
                if c.resume_at is not None and c.reference not in runs:
                    continue
                if need[c.name] <= free and not any(databases[c.name] & databases[o.name] for o in earlier):
                    pending.remove(c)
                    running[pool.submit(run, c)] = c
                    free -= need[c.name]
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                c = running.pop(future)
                free += need[c.name]
                r = runs[c.name] = future.result()
                log(f"{c.name:16s} exit {r.returncode}  {len(r.records)} iterations  {r.wall_s:5.1f} s")
    return {name: runs[name] for name in wanted}


#: Ranks :func:`run_matrix` runs at once (default: the machine's cores). 1: one case at a time.
MATRIX_SLOTS_ENV = "ADACC_E2E_SLOTS"


def _databases(c: Case) -> frozenset[str]:
    """The profile databases ``c`` touches: its own, and its budget probe's (none for a case without Adacc)."""
    if c.stock or not _adacc_on(list(c.flags)):
        return frozenset()
    source = case(c.budget_from) if c.budget_from else c
    return frozenset({c.profile_db, source.profile_db})


def trains(run: Run) -> bool:
    losses = [r["loss"] for r in run.records]
    return run.ok and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def passed(run: Run, runs: dict[str, Run]) -> bool:
    """Whether ``run`` meets its case's check (a reference case: it ran)."""
    if run.case.trains:
        return trains(run)
    if run.case.reference:
        return compare(run, runs[run.case.reference]).within
    return run.ok


def table(runs: dict[str, Run]) -> str:
    """The bit-identity table, Markdown."""
    lines = ["| case | flags | ranks | vs | result | max abs loss diff | wall (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in runs.items():
        c = run.case
        if c.trains:
            losses = [r["loss"] for r in run.records]
            verdict = (f"trains ({losses[0]:.3f} -> {losses[-1]:.3f})" if trains(run) else
                       f"FAILED (exit {run.returncode}, losses {', '.join(f'{x:.3f}' for x in losses)})")
            diff = ""
        elif c.reference is None:
            verdict, diff = ("reference" if run.ok else f"FAILED (exit {run.returncode})"), ""
        else:
            cmp = compare(run, runs[c.reference])
            verdict = ("bit-identical" if cmp.identical else
                       f"within {c.loss_tolerance}" if cmp.within else f"DIFFERS {cmp.note}".strip())
            diff = f"{cmp.max_loss_diff:.3g}"
        lines.append(f"| {name} | `{' '.join(c.flags) or '(stock)'}` | {c.nproc} | {c.reference or ''} | "
                     f"{verdict} | {diff} | {run.wall_s:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_adacc.testing.e2e", description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all but the on-demand ones)")
    parser.add_argument("--checkout", type=Path, help="patched Megatron-LM checkout")
    parser.add_argument("--unpatched", type=Path, help="the same commit, unpatched")
    parser.add_argument("--workdir", type=Path, default=Path("e2e-runs"))
    parser.add_argument("--out", type=Path, help="write the table (Markdown) here too")
    args = parser.parse_args(argv)
    if (args.checkout is None) != (args.unpatched is None):
        parser.error("--checkout and --unpatched go together")
    launcher = Checkout(args.checkout.resolve(), args.unpatched.resolve()) if args.checkout else EntryPoint()
    cases = [case(n) for n in args.cases] if args.cases else list(CI_CASES)
    runs = run_matrix(cases, launcher, args.workdir.resolve())
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = (f"# Megatron-LM end to end on CPU ({stamp}, {os.cpu_count()} cores, no GPU)\n\n{launcher.describe()}\n\n"
            f"{ITERATIONS} iterations of `{' '.join(SMALL_GPT)}` per case.\n\n{table(runs)}\n")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if all(passed(r, runs) for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
