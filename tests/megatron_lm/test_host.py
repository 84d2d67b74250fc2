"""``pretrain_gpt.py`` as a host that can measure a short run of its own command (megatron_lm.host): what
``--adacc-policy auto`` calibrates its CPU budget with under Megatron-LM. The whole path, through Megatron-LM's
real training loop, is the ``auto-budget`` case of tests/megatron_lm_training."""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest

from megatron_adacc import megatron_lm
from megatron_adacc.compat.process import solo_environment
from megatron_adacc.core import host
from megatron_adacc.megatron_lm.host import MEASURE_ENV, MegatronLMHost, apply_request, child_command

#: A stand-in for the user's command: it applies the request as configure() does, checks what it received and
#: exits, writing its figures as a measuring child of pretrain_gpt.py does.
_CHILD = textwrap.dedent("""
    import os, sys
    from types import SimpleNamespace
    from megatron_adacc.megatron_lm.host import apply_request
    args = SimpleNamespace(train_iters=100, save="/somewhere", adacc_policy="none")
    apply_request(args)
    assert (args.train_iters, args.save, args.adacc_policy) == (2, None, "auto"), vars(args)
    assert args.adacc_calibration_run is True
    assert os.environ["WORLD_SIZE"] == "1" and os.environ["RANK"] == "0"
    assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ, "would wait for its launcher's store forever"
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "65536"
""")


def test_the_host_runs_its_own_command_with_the_changes_and_reads_its_figures(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-c", _CHILD])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # as under torchrun
    monkeypatch.setattr(MegatronLMHost, "runs_training", True)
    result = MegatronLMHost().measure_run(SimpleNamespace(), env={"MALLOC_MMAP_THRESHOLD_": "65536"},
                                          adacc_policy="auto", train_iters=2, adacc_calibration_run=True)
    assert result is not None
    assert result["peak_memory_bytes"] > 2**20 and result["extensions"] == {}


def test_a_failed_measuring_run_answers_none_with_its_last_lines(monkeypatch, capsys, adacc_log):
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-c", "print('the error'); raise SystemExit(3)"])
    monkeypatch.setattr(MegatronLMHost, "runs_training", True)
    assert MegatronLMHost().measure_run(SimpleNamespace()) is None
    said = capsys.readouterr().err
    assert "exited with 3" in said and "the error" in said


def test_a_run_on_one_machine_measures_and_a_measuring_child_never_does(monkeypatch):
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # before Megatron starts it: torchrun's
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two machines: a measuring run would have to start both
    assert not MegatronLMHost().runs_training
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert MegatronLMHost().runs_training
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert MegatronLMHost().runs_training
    monkeypatch.setenv(MEASURE_ENV, "/a/request.json")
    assert not MegatronLMHost().runs_training


def test_without_a_request_the_arguments_are_left_alone(monkeypatch):
    monkeypatch.delenv(MEASURE_ENV, raising=False)
    args = SimpleNamespace(train_iters=100)
    apply_request(args)
    assert vars(args) == {"train_iters": 100}


def test_a_child_is_its_own_world_whatever_launched_its_parent():
    env = solo_environment({"RANK": "3", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True",
                            "TORCHELASTIC_RUN_ID": "x", "GROUP_WORLD_SIZE": "2", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


def test_installing_the_host_twice_keeps_one(monkeypatch):
    monkeypatch.setattr(host, "_CURRENT", [host.Host()])
    host.install(MegatronLMHost())
    host.install(MegatronLMHost())
    assert isinstance(host.current(), MegatronLMHost) and len(host._CURRENT) == 2
    megatron_lm.reset()  # forgetting the session uninstalls its host
    assert type(host.current()) is host.Host and len(host._CURRENT) == 1


def test_a_run_of_several_processes_is_measured_under_torchrun_with_what_it_runs():
    argv = ["/py", "-u", "-W", "ignore", "-m", "megatron_adacc.testing.pretrain_gpt", "--num-layers", "2"]
    assert child_command(argv, 1, 99) == argv
    assert child_command(argv, 2, 99) == [
        "/py", "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1", "--master_port=99",
        "-m", "megatron_adacc.testing.pretrain_gpt", "--num-layers", "2"]
    assert child_command(["/py", "pretrain_gpt.py", "--tp", "2"], 2, 7)[-3:] == ["pretrain_gpt.py", "--tp", "2"]
    with pytest.raises(ValueError, match="no script or module"):
        child_command(["/py", "-c", "pass"], 2, 7)
