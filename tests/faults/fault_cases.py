"""Bad inputs to the ``adacc`` command and what a refusal of them must look like (issue 22).

One table, two readers: ``test_fault_injection.py`` runs the cases marked ``ci`` (one representative of each
class, fast) under ``make test``; ``scripts/fault_sweep.py`` runs all of them and counts what went wrong. A case
is refused well when the command exits with :data:`EXIT_REFUSED`, stderr is one line that names the field, flag
or path at fault, nothing reads ``Traceback``, and no file changed except under a path that a flag names.

Each case runs the real CLI in a child process inside a sandbox folder (its working directory, ``$HOME`` and
``$TMPDIR``), so a refusal that writes a default output (``./adacc-policy.json``, ``~/.cache/...``) is seen.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_REFUSED = 2  # megatron_adacc.cli.EXIT_REFUSED; not imported, so that listing the cases loads no torch
#: The smallest model `adacc train` builds: a case that is wrongly accepted trains one step of it and ends.
SMALL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
         "--lr-warmup-iters", "0", "--no-progress", "--device", "cpu")
TRAIN = ("train", *SMALL)
SOLVE = ("solve", "--analytic", *SMALL)

Setup = Callable[[Path, Any], None]
"""Writes a case's inputs into its input folder; the second argument is the runner's shared artifacts."""


@dataclass(frozen=True)
class Case:
    """One bad command line. ``{in}`` in ``argv`` and ``env`` values is the case's input folder, which
    ``setup`` fills (from the :class:`Shared` artifacts when it needs a real checkpoint)."""

    name: str
    argv: tuple[str, ...]
    names: str
    """What the refusal's line must contain: the field, flag or path at fault."""
    setup: Setup | None = None
    ci: bool = False
    env: dict[str, str] = field(default_factory=dict)
    exit: int = EXIT_REFUSED

    @property
    def kind(self) -> str:
        return self.name.split("/", 1)[0]


# ------------------------------------------------------------------------------------------ inputs
def write(name: str, content: bytes | str) -> Setup:
    def setup(folder: Path, shared: Any) -> None:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return setup


def mkdir(name: str) -> Setup:
    return lambda folder, shared: (folder / name).mkdir(parents=True)


def both(*setups: Setup) -> Setup:
    def setup(folder: Path, shared: Any) -> None:
        for each in setups:
            each(folder, shared)
    return setup


def valid_policy() -> dict:
    """A policy file for :data:`SMALL` as `adacc solve` would write it: INT4 everywhere, every field present."""
    from megatron_adacc.adacc.policy.io import policy_to_json
    from megatron_adacc.adacc.policy.policy import Policy

    return policy_to_json(Policy.preset("quantize-all", 2))


def policy(change: Callable[[dict], object], name: str = "p.json") -> Setup:
    """A valid policy file with ``change`` applied to its JSON object (NaN and Infinity written as Python's
    json module writes them, which is how such a file would reach a user)."""
    def setup(folder: Path, shared: Any) -> None:
        obj = valid_policy()
        change(obj)
        (folder / name).write_text(json.dumps(obj))
    return setup


def _made_for_a_wider_model(obj: dict) -> None:
    from megatron_adacc.adacc.policy.signature import plain_signature

    obj["model_signature"] = plain_signature(hidden_size=96, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                                             micro_batch_size=2, dtype="float32", num_layers=2,
                                             megatron_core_version="0.16.1")


def decision(layer: int, index: int, **fields) -> Callable[[dict], object]:
    return lambda obj: obj["layers"][layer]["decisions"][index].update(fields)


def checkpoint(change: Callable[[Path], object] | None = None) -> Setup:
    """A copy of the shared checkpoint in ``{in}/ckpt``, with ``change`` applied to the copy."""
    def setup(folder: Path, shared: Any) -> None:
        target = folder / "ckpt"
        shutil.copytree(shared.checkpoint(), target)
        if change is not None:
            change(target)
    return setup


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_manifest(**fields) -> Callable[[Path], object]:
    def change(directory: Path) -> None:
        manifest = directory / "rank00000.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **fields}))
    return change


def sqlite_file(sql: str, name: str = "db.sqlite") -> Setup:
    def setup(folder: Path, shared: Any) -> None:
        import sqlite3
        from contextlib import closing

        with closing(sqlite3.connect(folder / name)) as con, con:
            con.executescript(sql)
    return setup


NESTED = "[" * 100_000 + "]" * 100_000
LATIN1 = '{"format": "megatron-adacc-policy", "name": "caf\xe9"}'.encode("latin-1")
BINARY = bytes(range(256)) * 4


def rehash(directory: Path) -> None:
    """Make the manifest's checksum match the state file again, as someone who controls both files can."""
    manifest = directory / "rank00000.json"
    digest = hashlib.sha256((directory / "rank00000.pt").read_bytes()).hexdigest()
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "sha256": digest}))


def truncate_pt(directory: Path) -> None:
    state = directory / "rank00000.pt"
    state.write_bytes(state.read_bytes()[:1000])
    rehash(directory)


def replace_with_dir(name: str) -> Callable[[Path], object]:
    def change(directory: Path) -> None:
        (directory / name).unlink()
        (directory / name).mkdir()
    return change


NESTED = "[" * 100_000 + "]" * 100_000
NESTED_OBJECTS = '{"a":' * 100_000 + "1" + "}" * 100_000
LATIN1 = '{"format": "megatron-adacc-policy", "name": "caf\xe9"}'.encode("latin-1")
BINARY = bytes(range(256)) * 4
P = "{in}/p.json"


# ------------------------------------------------------------------------------------------ the table
def policy_cases() -> list[Case]:
    """Policy files, read by ``adacc show`` and by ``adacc train --adacc-policy``; ``names`` is the field path."""
    bad = [  # (name, setup, what the line names, in CI)
        ("binary", write("p.json", BINARY), "p.json", True),
        ("latin1", write("p.json", LATIN1), "p.json", True),
        ("utf16", write("p.json", '{"format": 1}'.encode("utf-16")), "p.json", False),
        ("empty", write("p.json", b""), "p.json", False),
        ("truncated", write("p.json", '{"format": "megatron-adacc-policy", "lay'), "p.json", False),
        ("nested-lists", write("p.json", NESTED), "p.json", True),
        ("nested-objects", write("p.json", NESTED_OBJECTS), "p.json", False),
        ("top-level-list", write("p.json", "[]"), "'$'", False),
        ("top-level-null", write("p.json", "null"), "'$'", False),
        ("wrong-format", policy(lambda o: o.update(format="other")), "'format'", False),
        ("schema-version-2", policy(lambda o: o.update(schema_version=2)), "'schema_version'", False),
        ("schema-version-string", policy(lambda o: o.update(schema_version="1")), "'schema_version'", False),
        ("no-layers", policy(lambda o: o.pop("layers")), "'layers'", True),
        ("empty-layers", policy(lambda o: o.update(layers=[])), "'layers'", False),
        ("layers-not-list", policy(lambda o: o.update(layers={"0": 1})), "'layers'", False),
        ("layer-not-object", policy(lambda o: o["layers"].__setitem__(0, 7)), "'layers[0]'", False),
        ("too-few-decisions", policy(lambda o: o["layers"][0]["decisions"].pop()), "'layers[0].decisions'", False),
        ("op-out-of-order", policy(decision(0, 1, op="scores")), "'layers[0].decisions[1].op'", False),
        ("unknown-action", policy(decision(0, 2, action="drop")), "'layers[0].decisions[2].action'", False),
        ("recompute-checkpoint-op", policy(decision(0, 0, action="recompute", codec=None)),
         "'layers[0].decisions[0].action'", False),
        ("unknown-codec", policy(decision(1, 3, codec="zstd")), "'layers[1].decisions[3].codec'", True),
        ("codec-not-for-op", policy(decision(0, 1, codec="bitmask")), "'layers[0].decisions[1].codec'", False),
        ("negative-codec-param", policy(decision(0, 4, codec="stochastic", codec_params={"bits": -4})),
         "'layers[0].decisions[4].codec_params'", True),
        ("negative-group", policy(decision(0, 4, codec_params={"group": -8})),
         "'layers[0].decisions[4].codec_params'", False),
        ("unknown-codec-param", policy(decision(0, 4, codec_params={"levels": 3})),
         "'layers[0].decisions[4].codec_params'", False),
        ("codec-params-list", policy(decision(0, 4, codec_params=[1])),
         "'layers[0].decisions[4].codec_params'", False),
        ("codec-without-compress", policy(decision(0, 4, action="keep")), "'layers[0].decisions[4].codec'", False),
        ("negative-budget", policy(lambda o: o.update(budget_bytes=-1)), "'budget_bytes'", False),
        ("boolean-budget", policy(lambda o: o.update(budget_bytes=True)), "'budget_bytes'", False),
        ("signature-missing-field", policy(lambda o: o.update(model_signature={"hidden_size": 64})),
         "'model_signature.", False),
        ("predicted-string", policy(lambda o: o.update(predicted={"memory_bytes": "lots"})),
         "'predicted.memory_bytes'", False),
        ("a-directory", mkdir("p.json"), "p.json", False),
    ]
    cases = [Case(f"policy/{name}", ("show", P), names, setup, ci) for name, setup, names, ci in bad]
    train = [  # the same reader from the training side, and what only training can check
        ("train-unknown-codec", policy(decision(1, 3, codec="zstd")), "'layers[1].decisions[3].codec'", False),
        ("train-binary", write("p.json", BINARY), "p.json", False),
        ("train-missing", None, "--adacc-policy", False),
        ("train-other-layer-count", policy(lambda o: o["layers"].append(o["layers"][0])), "p.json", False),
        ("train-other-model", policy(lambda o: o["model_signature"].update(hidden_size=96)), "hidden_size", False),
    ]
    cases += [Case(f"policy/{name}", (*TRAIN, "--adacc-policy", P), names, setup, ci)
              for name, setup, names, ci in train]
    return cases


def nonfinite_cases() -> list[Case]:
    """NaN and Infinity wherever a number is read: flags, a config file, a policy file."""
    flags = [("--lr", "nan", True), ("--lr", "inf", False), ("--min-lr", "nan", False),
             ("--hidden-dropout", "nan", False), ("--attention-dropout", "inf", False),
             ("--weight-decay", "nan", False), ("--clip-grad", "inf", False), ("--adacc-outlier-z", "nan", False),
             ("--adacc-memory-headroom", "nan", False), ("--grad-compress-density", "nan", False),
             ("--gact-bits", "nan", False), ("--adama-clip-grad-per-tensor", "nan", False)]
    needs = {"--grad-compress-density": ("--resireduce", "residual"), "--gact-bits": ("--gact-level", "L2"),
             "--adama-clip-grad-per-tensor": ("--adama", "--clip-grad", "0")}
    cases = [Case(f"nonfinite/{flag[2:]}-{value}", (*TRAIN, *needs.get(flag, ()), flag, value), flag, None, ci)
             for flag, value, ci in flags]
    cases += [
        Case("nonfinite/budget-nan", (*SOLVE, "--budget", "nan"), "--budget"),
        Case("nonfinite/budget-inf", (*SOLVE, "--budget", "inf"), "--budget"),
        Case("nonfinite/config-lr-nan", (*TRAIN, "--config", "{in}/c.toml"), "lr",
             write("c.toml", "lr = nan\nmin_lr = nan\n")),
        Case("nonfinite/policy-budget-nan", ("show", P), "'budget_bytes'",
             policy(lambda o: o.update(budget_bytes=float("nan")))),
        Case("nonfinite/policy-z-infinity", ("show", P), "'layers[0].decisions[6].codec_params",
             policy(decision(0, 6, codec="int4_outlier", codec_params={"z_threshold": float("inf")})), ci=True),
        Case("nonfinite/policy-predicted-nan", ("show", P), "'predicted.memory_bytes'",
             policy(lambda o: o.update(predicted={"memory_bytes": float("nan")}))),
    ]
    return cases


def budget_cases() -> list[Case]:
    """Memory budgets: ``--adacc-memory-budget`` of ``adacc solve`` and ``adacc train`` (and solve's deprecated
    spelling ``--budget``, refused under that name)."""
    values = [("0", True), ("0.5", True), ("-1", True), ("12XB", True), ("", False), ("1e400", False),
              ("-12GiB", False), ("GiB", False), ("12 GiB GiB", False)]
    cases = [Case(f"budget/solve-{value or 'empty'}", (*SOLVE, "--adacc-memory-budget", value),
                  "--adacc-memory-budget", None, ci) for value, ci in values]
    cases += [Case(f"budget/solve-deprecated-{value}", (*SOLVE, "--budget", value), "--budget")
              for value in ("0", "12XB")]
    cases += [Case(f"budget/train-{value or 'empty'}", (*TRAIN, "--adacc-policy", "auto", "--adacc-memory-budget",
                                                           value), "--adacc-memory-budget")
              for value in ("0", "12XB", "-1GiB")]
    cases += [
        Case("budget/solve-infeasible", (*SOLVE, "--adacc-memory-budget", "1KiB"), "smallest feasible budget",
             ci=True),
        Case("budget/headroom-negative", (*TRAIN, "--adacc-policy", "auto", "--adacc-memory-headroom", "-0.1"),
             "--adacc-memory-headroom"),
        Case("budget/headroom-one", (*TRAIN, "--adacc-policy", "auto", "--adacc-memory-headroom", "1"),
             "--adacc-memory-headroom"),
        Case("budget/process-baseline-negative", (*TRAIN, "--adacc-policy", "auto", "--adacc-process-baseline",
                                                  "-1"), "--adacc-process-baseline"),
    ]
    return cases


def flag_cases() -> list[Case]:
    """One flag out of range, or two that cannot work together; ``names`` is the flag."""
    single = ["--micro-batch-size 0", "--micro-batch-size -1", "--micro-batch-size two", "--num-layers 0",
              "--hidden-size 0", "--seq-length 0", "--train-iters 0", "--global-batch-size 0", "--ffn-hidden-size 0",
              "--global-batch-size 3", "--lr -1", "--hidden-dropout 1.5", "--attention-dropout -0.1",
              "--clip-grad -1", "--weight-decay -1", "--lr-warmup-iters -1", "--eval-iters -1", "--save-interval 0",
              "--recompute-num-layers 0", "--adacc-evolution-cap 0", "--adacc-outlier-z -1", "--adacc-codec zstd",
              "--device cuda", "--frobnicate", "--num-layers", "positional"]
    in_ci = ("--micro-batch-size 0", "--frobnicate")
    cases = [Case(f"flags/{'-'.join(f.lstrip('-') for f in line.split())}", (*TRAIN, *line.split()), line.split()[0],
                  None, line in in_ci) for line in single]
    cases.append(Case("flags/heads-not-dividing-hidden", (*TRAIN, "--hidden-size", "64", "--num-attention-heads", "3"),
                      "--num-attention-heads", ci=True))
    pairs = [  # (name, flags, the flag named, in CI)
        ("adama-gact", ("--adama", "--clip-grad", "0", "--gact-level", "L2"), "--gact-level", True),
        ("adama-clip-grad", ("--adama", "--clip-grad", "1.0"), "--clip-grad", False),
        ("adacc-gact", ("--adacc-policy", "keep", "--gact-level", "L2"), "--gact-level", False),
        ("adacc-megatron-recompute", ("--adacc-policy", "keep", "--recompute-granularity", "full",
                                      "--recompute-method", "uniform", "--recompute-num-layers", "1"),
         "--recompute-granularity", False),
        ("recompute-without-method", ("--recompute-granularity", "full"), "--recompute-method", False),
        ("recompute-unknown-module", ("--recompute-granularity", "selective", "--recompute-modules", "bogus"),
         "--recompute-modules", False),
        ("density-zero", ("--resireduce", "residual", "--grad-compress-density", "0"), "--grad-compress-density",
         False),
        ("density-above-one", ("--resireduce", "residual", "--grad-compress-density", "1.5"),
         "--grad-compress-density", False),
        ("qsgd-levels-zero", ("--resireduce", "residual", "--grad-compressor", "qsgd", "--qsgd-levels", "0"),
         "--qsgd-levels", False),
        ("resireduce-group-zero", ("--resireduce", "w", "--resireduce-group-size", "0"), "--resireduce-group-size",
         False),
        ("resireduce-ratio-two", ("--resireduce", "w", "--resireduce-ratio", "2"), "--resireduce-ratio", False),
        ("gact-bits-zero", ("--gact-level", "L2", "--gact-bits", "0"), "--gact-bits", False),
        ("gact-bits-64", ("--gact-level", "L2", "--gact-bits", "64"), "--gact-bits", False),
        ("gact-interval-zero", ("--gact-level", "L2", "--gact-adapt-interval", "0"), "--gact-adapt-interval", False),
        ("gact-group-zero", ("--gact-level", "L2", "--gact-group-size", "0"), "--gact-group-size", False),
        ("gact-flag-with-gact-off", ("--gact-bits", "2"), "--gact-bits", False),
        ("adacc-flag-with-adacc-off", ("--adacc-memory-budget", "1GiB"), "--adacc-memory-budget", False),
        ("adama-per-tensor-negative", ("--adama", "--clip-grad", "0", "--adama-clip-grad-per-tensor", "-1"),
         "--adama-clip-grad-per-tensor", False),
        ("adama-distributed-per-tensor", ("--adama", "--use-distributed-optimizer", "--adama-clip-grad-per-tensor",
                                          "1"), "--adama-clip-grad-per-tensor", False),
        ("ddp-bucket-size-zero", ("--ddp-bucket-size", "0"), "--ddp-bucket-size", False),
    ]
    cases += [Case(f"flags/{name}", (*TRAIN, *flags), names, None, ci) for name, flags, names, ci in pairs]
    return cases


def command_cases() -> list[Case]:
    """The command itself, configs, and outputs that cannot be written."""
    return [
        Case("command/unknown", ("frobnicate",), "frobnicate", ci=True),
        Case("command/show-without-file", ("show",), "policy"),
        Case("command/bench-unknown", ("bench", "frobnicate"), "frobnicate"),
        Case("command/solve-unknown-flag", (*SOLVE, "--frobnicate"), "--frobnicate"),
        Case("config/missing", (*TRAIN, "--config", "{in}/nope.toml"), "nope.toml"),
        Case("config/junk", (*TRAIN, "--config", "{in}/c.toml"), "c.toml", write("c.toml", "lr = = 3\n"), ci=True),
        Case("config/binary", (*TRAIN, "--config", "{in}/c.toml"), "c.toml", write("c.toml", BINARY)),
        Case("config/a-directory", (*TRAIN, "--config", "{in}/c.toml"), "c.toml", mkdir("c.toml")),
        Case("config/unknown-key", (*TRAIN, "--config", "{in}/c.toml"), "frobnicate",
             write("c.toml", "frobnicate = 1\n")),
        Case("config/wrong-type", ("train", "--config", "{in}/c.toml", "--no-progress"), "num_layers",
             write("c.toml", 'num_layers = "two"\n')),
        Case("config/zero-layers", ("train", "--config", "{in}/c.toml", "--no-progress"), "num-layers",
             write("c.toml", "num_layers = 0\n")),
        Case("output/solve-into-directory", (*SOLVE, "-o", "{in}/out"), "out", mkdir("out")),
        Case("output/solve-under-a-file", (*SOLVE, "-o", "{in}/f/p.json"), "f", write("f", "x")),
        Case("output/json-into-directory", (*TRAIN, "--output-json", "{in}/out"), "out", mkdir("out"), ci=True),
        Case("output/json-under-a-file", (*TRAIN, "--output-json", "{in}/f/s.json"), "f", write("f", "x")),
        Case("output/save-to-a-file", (*TRAIN, "--save", "{in}/f"), "--save", write("f", "x")),
    ]


def checkpoint_cases() -> list[Case]:
    """``adacc train --load`` of checkpoints that must not be loaded; each names ``--load`` and its folder."""
    load = (*TRAIN, "--train-iters", "2", "--load", "{in}/ckpt")
    pt = lambda content: lambda d: (d / "rank00000.pt").write_bytes(content)  # noqa: E731
    bad = [  # (name, the checkpoint's change, extra flags, in CI)
        ("junk", pt(b"not a checkpoint"), (), True),
        ("bit-flipped", lambda d: flip_bytes(d / "rank00000.pt"), (), True),
        ("foreign-model", None, ("--hidden-size", "96"), True),
        ("other-optimizer", None, ("--adama", "--clip-grad", "0"), False),
        ("other-features", None, ("--gact-level", "L1"), False),  # Adacc may change: its state is optional
        ("no-manifest", lambda d: (d / "rank00000.json").unlink(), (), False),
        ("no-state", lambda d: (d / "rank00000.pt").unlink(), (), False),
        ("manifest-junk", lambda d: (d / "rank00000.json").write_bytes(BINARY), (), False),
        ("manifest-list", lambda d: (d / "rank00000.json").write_text("[]"), (), False),
        ("manifest-format-2", edit_manifest(format=2), (), False),
        ("manifest-model-number", edit_manifest(model=5), (), False),
        ("manifest-features-number", edit_manifest(features=5), (), False),
        ("truncated-rehashed", truncate_pt, (), False),
        ("pickle-rehashed", lambda d: (pt(b"\x80\x04cos\nsystem\n.")(d), rehash(d)), (), False),
        ("iteration-mismatch", lambda d: (edit_manifest(iteration=7)(d), rehash(d)), (), False),
        ("state-is-a-directory", replace_with_dir("rank00000.pt"), (), False),
        ("manifest-is-a-directory", replace_with_dir("rank00000.json"), (), False),
    ]
    cases = [Case(f"checkpoint/{name}", (*load, *flags), "--load", checkpoint(change), ci)
             for name, change, flags, ci in bad]
    cases += [
        Case("checkpoint/empty-folder", load, "--load", mkdir("ckpt")),
        Case("checkpoint/missing-folder", load, "--load"),
        Case("checkpoint/a-file", load, "--load", write("ckpt", "x")),
    ]
    return cases


def profile_db_cases() -> list[Case]:
    """Profile databases named by ``--adacc-profile-db`` or ``$ADACC_PROFILE_DB``; each names the path."""
    db = "{in}/db.sqlite"
    solve = ("solve", *SMALL, "--adacc-profile-db", db)
    auto = (*TRAIN, "--adacc-policy", "auto", "--adacc-profile-db", db)
    return [
        Case("profile-db/junk-file", solve, "db.sqlite", write("db.sqlite", BINARY), ci=True),
        Case("profile-db/a-directory", solve, "db.sqlite", mkdir("db.sqlite"), ci=True),
        Case("profile-db/train-junk-file", auto, "db.sqlite", write("db.sqlite", b"SQLite format 3\x00junk" * 64)),
        Case("profile-db/profile-junk-file", ("profile", *SMALL, "--adacc-profile-db", db), "db.sqlite",
             write("db.sqlite", BINARY)),
        Case("profile-db/env-junk-file", ("solve", *SMALL), "db.sqlite", write("db.sqlite", BINARY),
             env={"ADACC_PROFILE_DB": db}),
        Case("profile-db/env-directory", (*TRAIN, "--adacc-policy", "auto"), "db.sqlite", mkdir("db.sqlite"),
             env={"ADACC_PROFILE_DB": db}),
        Case("profile-db/under-a-file", ("solve", *SMALL, "--adacc-profile-db", "{in}/f/db.sqlite"), "f",
             write("f", "x")),
        Case("profile-db/foreign-sqlite", solve, "db.sqlite", sqlite_file("CREATE TABLE profiles (x);")),
        Case("profile-db/empty-path", ("solve", *SMALL, "--adacc-profile-db", ""), "--adacc-profile-db"),
    ]


CASE_SETS = (policy_cases, nonfinite_cases, budget_cases, flag_cases, command_cases, checkpoint_cases,
             profile_db_cases)


def all_cases() -> list[Case]:
    cases = [case for make in CASE_SETS for case in make()]
    assert len({c.name for c in cases}) == len(cases), "two cases share a name"
    return cases


def ci_cases() -> list[Case]:
    return [case for case in all_cases() if case.ci]
