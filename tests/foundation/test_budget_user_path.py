"""`adacc train --adacc-policy auto --adacc-memory-budget B`, the way a user runs it, keeps B (issue: the budget a
user gives is the budget the run keeps): profiling runs in a child process, the process memory outside the cost
model is calibrated by the host, and a cold profile cache trains exactly as a warm one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adacc.adacc.integration import auto
from megatron_adacc.adacc.policy.profile_db import ProfileDB
from megatron_adacc.core import host
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

REPO = Path(__file__).resolve().parents[2]
FEW = ["--train-iters", "3", "--no-progress"]


@pytest.fixture(autouse=True)
def _uninstall():
    yield
    from megatron_adacc.adacc.integration import uninstall

    uninstall()


def _adacc_train(flags: list[str], db: Path, out: Path, *, refused: bool = False) -> dict | str:
    """`adacc train` as a user runs it: its summary, or (``refused``) the one line of its refusal."""
    env = {**os.environ, "ADACC_PROFILE_DB": str(db), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron_adacc.cli", "train", *flags, "--output-json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if refused:
        assert proc.returncode == 2, proc.stderr[-4000:]
        return proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.long
def test_a_cold_cache_run_keeps_its_budget(tmp_path):
    """The tiny config at a budget between the smallest one Adacc can keep and stock Megatron's own peak, both
    measured here first: what a process holds besides its tensors depends on the machine and its libraries, so
    no fixed figure would mean the same everywhere (a budget 16 MiB under stock's was infeasible in a fresh
    clone once the calibration counted the MILP solver). The smallest comes from a refused run on another
    profile database, so that the measured run profiles and calibrates itself (the cold cache). Both runs are
    children of this test worker, which holds hundreds of MiB by the time the suite gets here: a peak that
    counted the parent's (``ru_maxrss`` does, core.devices) failed this test in CI.

    Before the fix, cpu-large at 917 MiB peaked at 1512 MiB (65% over). The run keeps the default headroom, as
    a user's does: 1% of this budget (about 4.4 MiB) did not cover what tiny's mixed policies touch beyond the
    keep-everything calibration (up to 5.5 MiB), and the floor of 8 MiB does (issue 18, item 1)."""
    auto_at = ["--adacc-policy", "auto", *FEW, "--adacc-memory-budget"]
    stock = _adacc_train(FEW, tmp_path / "stock.sqlite", tmp_path / "stock.json")["peak_memory_bytes"]
    line = _adacc_train([*auto_at, "1MiB"], tmp_path / "probe.sqlite", tmp_path / "probe.json", refused=True)
    smallest = int(re.search(r"smallest feasible budget is ([\d,]+) bytes", line).group(1).replace(",", ""))
    assert smallest < stock, (smallest, stock)  # Adacc can run below stock Megatron's peak at all
    budget = (smallest + stock) // 2
    db = tmp_path / "profile.sqlite"
    summary = _adacc_train([*auto_at, str(budget)], db, tmp_path / "run.json")
    report = summary["extensions"]["adacc"]
    figures = {k: report[k] for k in ("peak_bytes", "predicted_peak_bytes", "budget_bytes")}
    assert report["over_budget"] is False and summary["peak_memory_bytes"] <= budget, figures
    assert report["decisions"] != {"keep": 52}  # the budget made Adacc save memory
    key = auto._run_key(parse_train_args(FEW))
    assert key.endswith(";steps=3")  # calibrated over the run's own 3 steps, not 30
    assert ProfileDB(db).get_baseline(1, key) is not None
    assert ProfileDB(db).get_baseline(1, key + auto._CODEC_PAGES) is not None  # the compressing run's share


def test_cold_and_warm_profile_caches_train_bit_for_bit(tmp_path, monkeypatch):
    """Profiling in a child leaves this process's random streams alone (the budget is fixed here, so that
    the two runs solve the same policy whatever this process's resident size)."""
    monkeypatch.setenv("ADACC_PROFILE_DB", str(tmp_path / "profile.sqlite"))
    flags = ["--adacc-policy", "auto", "--adacc-memory-budget", "430MiB", "--adacc-process-baseline", "360MiB",
             "--adacc-no-evolution", *FEW]
    cold = train(parse_train_args(flags))
    warm = train(parse_train_args(flags))
    assert cold["extensions"]["adacc"]["decisions"] == warm["extensions"]["adacc"]["decisions"]
    assert cold["losses"] == warm["losses"]


def test_without_a_host_that_runs_training_the_resident_size_is_counted(tmp_path):
    ref = {"db": str(tmp_path / "p.sqlite"), "id": 1}
    ProfileDB(ref["db"])
    args = parse_train_args(["--micro-batch-size", "4"])
    logs: list[str] = []
    assert host.current().runs_training is False
    assert auto.process_baseline(args, None, ref, 123 * 2**20, logs.append) == 123 * 2**20
    assert "not in it" in logs[-1]


def test_a_stored_calibration_is_reused(tmp_path):
    db = ProfileDB(tmp_path / "p.sqlite")
    args = parse_train_args(["--micro-batch-size", "4"])
    db.put_baseline(7, auto._run_key(args), 400 * 2**20)
    logs: list[str] = []
    ref = {"db": str(db.path), "id": 7}
    assert auto.process_baseline(args, None, ref, 1, logs.append) == 400 * 2**20
    assert "calibrated for micro_batch_size=4" in logs[-1] and "on profile #7" in logs[-1]
    assert db.get_baseline(7, auto._run_key(parse_train_args(["--micro-batch-size", "8"]))) is None


def test_a_calibration_is_as_long_as_the_run_and_a_longer_run_never_reuses_a_shorter_one(tmp_path):
    """A 3-step run calibrates over 3 steps (a run never peaks in steps it does not take) and stores that under
    its own key; a full-length calibration covers a shorter run (its heap grew over more steps), never the
    other way round."""
    db = ProfileDB(tmp_path / "p.sqlite")
    short, long_ = parse_train_args(["--train-iters", "3"]), parse_train_args(["--train-iters", "500"])
    assert (auto.calibration_steps(short), auto.calibration_steps(long_)) == (3, auto.CALIBRATION_STEPS)
    ref = {"db": str(db.path), "id": 3}
    db.put_baseline(3, auto._run_key(short), 300 * 2**20)
    assert auto.process_baseline(short, None, ref, 1, lambda _: None) == 300 * 2**20
    assert auto._stored_baseline(db, 3, long_) is None  # the 500-step run calibrates its own 30 steps
    db.put_baseline(3, auto._run_key(long_), 310 * 2**20)
    assert auto._stored_baseline(db, 3, parse_train_args(["--train-iters", "5"])) == 310 * 2**20
    assert auto._stored_baseline(db, 3, short) == 300 * 2**20  # its own first


@pytest.mark.parametrize("peak, over", [(100, False), (10**12, True)])
def test_the_run_says_loudly_when_it_went_over_its_budget(capsys, peak, over, monkeypatch, adacc_log):
    import torch

    from megatron_adacc.adacc.integration import extension

    ext = extension.AdaccExtension.__new__(extension.AdaccExtension)
    ext.budget_bytes, ext._params = 10**9, [torch.zeros(1)]
    monkeypatch.setattr(extension, "peak_memory_bytes", lambda device: peak)
    assert ext._budget_check(900 * 10**6)["over_budget"] is over
    assert ("OVER its memory budget" in capsys.readouterr().err) is over


def test_the_calibrated_process_memory_covers_the_peak_and_every_traced_stage():
    """The process memory outside the model is the larger of what the calibration run's peak exceeds the model
    by and the largest excess of a traced stage over its bound: the peak need not fall in a traced stage (the
    trace sees a step's first micro-batch), and a stage can exceed its bound by more than the peak exceeds the
    model's (the model's largest stage is not the measured one)."""
    from megatron_adacc.adacc.policy.profile import analytic_profile
    from megatron_adacc.adacc.policy.solver import SolveOptions, make_problem
    from megatron_adacc.adacc.runtime import stages

    sig = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32, micro_batch_size=2,
               dtype="float32", num_layers=3, vocab_size=256)
    profile = analytic_profile(sig)
    problem = make_problem(profile, None, SolveOptions())
    keep = problem.stock_picks()
    total = problem.total_memory([keep] * 3, stash=True)
    bound = stages.bounds(problem.fixed_bytes, problem.workspace_bytes, [problem.layer_memory(keep, stash=True)] * 3,
                          [problem.stage_bytes(keep, stash=True)] * 3)
    traced = [{"stage": "head", "peak_bytes": bound["head"] + 5e6},
              {"stage": "L2/softmax", "peak_bytes": bound["L2/softmax"] + 9e6},
              {"stage": "L0/softmax", "peak_bytes": bound["L0/softmax"] + 40e6}]  # not the bound's own layer
    assert abs(auto.baseline_from_run(profile, int(total + 1e6), traced) - 9e6) <= 1
    assert abs(auto.baseline_from_run(profile, int(total + 50e6), traced) - 50e6) <= 1
    assert abs(auto.baseline_from_run(profile, int(total + 7e6), []) - 7e6) <= 1
    # the last layer's forward stages count too (profiles that measured each op's forward)
    for i, op in enumerate(profile.ops):
        op.forward_bytes = 1000 * (i + 1)
    problem = make_problem(profile, None, SolveOptions())
    forward = stages.bounds(problem.fixed_bytes, problem.workspace_bytes, [problem.layer_memory(keep, stash=True)] * 3,
                            [problem.stage_bytes(keep, stash=True)] * 3, [problem.forward_stages(keep, stash=True)] * 3)
    total = problem.total_memory([keep] * 3, stash=True)
    traced = [{"stage": "F2/linear_fc1", "peak_bytes": forward["F2/linear_fc1"] + 12e6},
              {"stage": "F1/linear_fc1", "peak_bytes": forward["F1/linear_fc1"] + 30e6}]  # not the bound's own layer
    assert abs(auto.baseline_from_run(profile, int(total + 1e6), traced) - 12e6) <= 1


def test_a_compressing_calibration_run_is_read_against_its_own_policy():
    """The compressing calibration run compresses every op with its layer-specific codec: its excess is read
    against that policy's bounds, not the keep-everything ones (which would put every stage tens of MiB under)."""
    from megatron_adacc.adacc.policy.policy import Policy
    from megatron_adacc.adacc.policy.profile import analytic_profile
    from megatron_adacc.adacc.policy.solver import evaluate_policy

    sig = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32, micro_batch_size=2,
               dtype="float32", num_layers=3, vocab_size=256)
    profile = analytic_profile(sig)
    compress = evaluate_policy(profile, Policy.uniform("compress", 3))["memory_bytes"]
    assert compress < evaluate_policy(profile, Policy.all_keep(3))["memory_bytes"]
    assert abs(auto.baseline_from_run(profile, int(compress + 3e6), [], compressing=True) - 3e6) <= 1


@pytest.mark.long
def test_a_profile_of_another_model_is_not_reused(tmp_path, monkeypatch):
    """`auto` on the same database for a model that differs in one signature field (GQA's query groups) profiles
    that model: a second profile beside the first, never the first one's costs for another layer."""
    db = tmp_path / "profile.sqlite"
    monkeypatch.setenv("ADACC_PROFILE_DB", str(db))
    flags = ["--adacc-policy", "auto", "--adacc-memory-budget", "2GiB", "--adacc-no-evolution", "--train-iters", "1",
             "--no-progress", "--num-layers", "2", "--seq-length", "64", "--micro-batch-size", "2",
             "--global-batch-size", "2"]
    train(parse_train_args(flags))
    train(parse_train_args([*flags, "--group-query-attention", "--num-query-groups", "2"]))
    profiles = ProfileDB(db).list()
    assert len(profiles) == 2, profiles
    groups = sorted(p["signature"]["num_query_groups"] for p in profiles)
    assert groups == [2, 4], groups
