"""How a refusal reaches the user of the patched ``pretrain_gpt.py``: one line, said once for all ranks, as
``adacc``'s own commands say it; and the flags of a feature left off, refused as ``adacc train`` refuses them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from megatron_lm_fakes import megatron_args

from megatron_adacc import megatron_lm
from megatron_adacc.core.errors import DEBUG_ENV, AdaccError
from megatron_adacc.megatron_lm import IntegrationError
from megatron_adacc.megatron_lm import session as session_mod

REPO = Path(__file__).resolve().parents[2]

#: pretrain_gpt.py's two calls into us, on a parser whose only Megatron-LM flag is --inprocess-restart (on):
#: with --resireduce, one host problem; with --gact-bits, a second, so the message has a list to join.
PRETRAIN = textwrap.dedent("""
    import argparse, sys
    import megatron_adacc.megatron_lm as lm
    parser = lm.extra_args_provider(None)(argparse.ArgumentParser(allow_abbrev=False))
    parser.set_defaults(inprocess_restart=True)
    lm.configure(parser.parse_args(sys.argv[1:]))
""")
ARGV = ["--resireduce", "a", "--gact-bits", "2"]


def _pretrain(rank: str, **env: str) -> subprocess.CompletedProcess:
    """Run PRETRAIN as rank ``rank`` of a torchrun job; an uncaught exception ends it, as in pretrain_gpt.py."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", DEBUG_ENV)} | {"RANK": rank} | env
    return subprocess.run([sys.executable, "-c", PRETRAIN, *ARGV], cwd=REPO, env=environ, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def previous(monkeypatch):
    """What the hook before ours saw; ours is installed over it as sys.excepthook (both put back after)."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    session_mod._one_line_refusals()
    return seen


def test_a_refusal_is_one_line_on_rank_0():
    out = _pretrain("0")
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "megatron-adacc: cannot run this command line: megatron-adacc attaches to the model once "
        "per process; --inprocess-restart rebuilds it in the same process. Drop --inprocess-restart; --gact-bits "
        "configures gact, which is off: turn it on with --gact-level, or drop it"]


def test_other_ranks_leave_an_ordinary_refusal_to_rank_0():
    out = _pretrain("1")
    assert (out.returncode, out.stderr) == (1, "")


def test_adacc_debug_shows_the_traceback_on_every_rank():
    out = _pretrain("1", **{DEBUG_ENV: "1"})
    assert out.returncode == 1
    assert out.stderr.startswith("Traceback") and "IntegrationError: cannot run" in out.stderr


def test_a_refusal_one_rank_may_meet_alone_names_that_rank(previous, monkeypatch, capsys):
    class Stalled(AdaccError):
        every_rank = True

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # another test's group would answer
    sys.excepthook(Stalled, Stalled("rank 2 stopped answering:\n  - restart the job"), None)
    assert capsys.readouterr().err == "megatron-adacc: rank 3: rank 2 stopped answering: restart the job\n"


def test_the_rank_is_torch_distributeds_once_initialized(previous, monkeypatch, capsys):
    """Refusals from training-loop hooks come after Megatron initialized torch.distributed: its rank counts."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    sys.excepthook(IntegrationError, IntegrationError("no"), None)
    assert capsys.readouterr().err == "" and previous == []


def test_other_exceptions_keep_the_previous_hook(previous, capsys):
    error = RuntimeError("a bug")
    sys.excepthook(RuntimeError, error, None)
    assert previous == [error] and capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------- idle flags


def test_a_flag_of_a_feature_left_off_is_refused_although_nothing_is_on(fake_training, monkeypatch):
    """--gact-bits without --gact-level would start the stock run its user did not ask for."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--gact-bits", "2"])
    train_step = fake_training.train_step
    with pytest.raises(IntegrationError, match=r"--gact-bits configures gact, which is off: turn it on with "
                                               r"--gact-level"):
        megatron_lm.configure(megatron_args("--gact-bits", "2"), training=fake_training)
    assert fake_training.train_step is train_step and megatron_lm.current_session() is None


def test_idle_flags_are_listed_with_the_hosts_problems():
    argv = ["--adama", "--resireduce-phi=0.5", "--gact-bits", "2"]
    with pytest.raises(IntegrationError) as err:
        megatron_lm.check_combination(megatron_args("--adama", inprocess_restart=True),
                                      megatron_lm.enabled_features(megatron_args("--adama")), argv)
    found = str(err.value).split("\n  - ")[1:]
    assert [line.split(" ")[0] for line in found] == ["megatron-adacc", "--resireduce-phi", "--gact-bits"]


def test_a_flag_at_its_off_value_is_not_idle(fake_training, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--gact-level", "L0", "--adacc-policy=none"])
    assert megatron_lm.configure(megatron_args("--gact-level", "L0", "--adacc-policy=none"),
                                 training=fake_training) is None
