"""configure / attach and the training-loop wrappers, against a stand-in for Megatron-LM's training module."""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from megatron_lm_fakes import (
    RecordingExtension,
    batch_forward_step,
    forward_step,
    make_fake_training,
    megatron_args,
)

from megatron_adacc import megatron_lm
from megatron_adacc.megatron_lm import FeatureUnavailable, IntegrationError
from megatron_adacc.megatron_lm import session as session_mod

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def recording(monkeypatch):
    """Every enabled feature's entry point resolves, and the extensions built are one RecordingExtension."""
    extension = RecordingExtension()
    built = []

    def build_extensions(features, args, config):
        built.append((args, config))
        return [extension]

    monkeypatch.setattr(session_mod, "build_extensions", build_extensions)
    extension.built = built
    return extension


def _originals(training):
    return {name: getattr(training, name) for name in session_mod.HOOKED_FUNCTIONS}


# ------------------------------------------------------------------------------------------- policy none


def test_none_installs_nothing(fake_training):
    before = _originals(fake_training)
    assert megatron_lm.configure(megatron_args("--adacc-policy", "none"), training=fake_training) is None
    assert _originals(fake_training) == before  # the very same function objects
    assert megatron_lm.current_session() is None


def test_none_imports_nothing_beyond_argument_parsing():
    """With every flag off, the patched pretrain_gpt.py imports our arguments code and nothing else: not
    torch, not Megatron, not one feature package.
    Runs in a fresh interpreter so that other tests' imports do not count."""
    code = textwrap.dedent("""
        import argparse, json, sys, types
        import megatron_adacc.megatron_lm as lm
        parser = lm.extra_args_provider(None)(argparse.ArgumentParser(allow_abbrev=False))
        args = parser.parse_args(["--adacc-policy", "none"])
        fake = types.ModuleType("fake_training")
        fake.train_step = fake.setup_model_and_optimizer = fake.get_megatron_optimizer = print
        assert lm.configure(args, training=fake) is None
        assert fake.train_step is print and fake.setup_model_and_optimizer is print
        roots = ("torch", "megatron", "megatron_adacc")
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in roots)))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    # The registry entries (one light module per feature, in its package) and the seam; no feature's code.
    entries = {f"megatron_adacc.{package}{module}" for package in ("adacc", "comm", "gact", "optim")
               for module in ("", ".feature")}
    assert set(modules) == entries | {
        "megatron_adacc", "megatron_adacc.arguments", "megatron_adacc.features",
        "megatron_adacc.core", "megatron_adacc.core.errors", "megatron_adacc.core.extension",
        "megatron_adacc.core.features", "megatron_adacc.core.lazy", "megatron_adacc.core.patching",
        "megatron_adacc.core.units", "megatron_adacc.core.log",  # logging's names only (--logging-level's type)
        "megatron_adacc.comm.options", "megatron_adacc.gact.levels", "megatron_adacc.models",  # the flags' names
        "megatron_adacc.megatron_lm", "megatron_adacc.megatron_lm.arguments", "megatron_adacc.megatron_lm.features",
        "megatron_adacc.megatron_lm.session"}


# ---------------------------------------------------------------------------------------- flag checks

BAD_COMBINATIONS = [
    (["--adacc-policy", "auto"], {"recompute_granularity": "full"}, "drop --recompute-granularity"),
    (["--adacc-policy", "auto"], {"transformer_impl": "transformer_engine"}, "--transformer-impl local"),
    (["--adacc-policy", "quantize-all"], {"fp8": "hybrid"}, "--fp8-format"),
    (["--adacc-policy", "auto"], {"num_experts": 8}, "--num-experts"),
    (["--adacc-policy", "auto"], {"fine_grained_activation_offloading": True},
     "--fine-grained-activation-offloading"),
    (["--gact-level", "L1"], {"cuda_graph_impl": "local"}, "--cuda-graph-impl none"),
    (["--adacc-policy", "auto", "--gact-level", "L1"], {}, "--adacc-codec gact"),
    (["--adama", "--resireduce", "w"], {}, "no gradient left for --resireduce"),
    (["--adama", "--gact-level", "L1"], {}, "would fold into Adam's moments"),
    (["--adama"], {"gradient_accumulation_fusion": True}, "--no-gradient-accumulation-fusion"),
    (["--adama"], {"use_distributed_optimizer": True, "overlap_param_gather": True}, "drop --overlap-param-gather"),
    (["--adama"], {"clip_grad": 1.0}, "add --use-distributed-optimizer, or pass --clip-grad 0"),
    (["--adama"], {"overlap_grad_reduce": True}, "--overlap-grad-reduce"),
    (["--resireduce", "a"], {"use_torch_fsdp2": True}, "--use-torch-fsdp2"),
    (["--resireduce", "a"], {"num_distributed_optimizer_instances": 2},
     "--num-distributed-optimizer-instances"),
    (["--resireduce", "a"], {"inprocess_restart": True}, "--inprocess-restart"),
]


@pytest.mark.parametrize("argv, megatron, message", BAD_COMBINATIONS, ids=[m for _, _, m in BAD_COMBINATIONS])
def test_bad_combinations_fail_before_anything_is_installed(fake_training, argv, megatron, message):
    before = _originals(fake_training)
    with pytest.raises(IntegrationError) as err:
        megatron_lm.configure(megatron_args(*argv, **megatron), training=fake_training)
    assert message in str(err.value)
    assert _originals(fake_training) == before


def test_every_problem_is_reported_at_once(fake_training):
    args = megatron_args("--adacc-policy", "auto", recompute_granularity="selective", num_experts=4)
    with pytest.raises(IntegrationError) as err:
        megatron_lm.configure(args, training=fake_training)
    assert str(err.value).count("\n  - ") == 2


def test_flags_lost_to_yaml_cfg_are_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", "x.yaml", "--adacc-policy=auto"])
    with pytest.raises(IntegrationError, match=r"--adacc-policy were given .* --yaml-cfg"):
        megatron_lm.configure(argparse.Namespace(yaml_cfg="x.yaml"))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", "x.yaml"])
    assert megatron_lm.configure(argparse.Namespace(yaml_cfg="x.yaml")) is None  # no flag of ours: stock run


def test_a_missing_policy_file_fails_before_megatron_starts(fake_training, tmp_path):
    before = _originals(fake_training)
    with pytest.raises(FileNotFoundError, match=r"neither auto, a preset .* nor an existing policy file"):
        megatron_lm.configure(megatron_args("--adacc-policy", str(tmp_path / "nope.json")),
                              training=fake_training)
    assert _originals(fake_training) == before


def test_an_unavailable_feature_names_its_flag(fake_training, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron_adacc.comm.extension", None)  # its import now fails
    before = _originals(fake_training)
    with pytest.raises(FeatureUnavailable, match=r"--resireduce needs megatron_adacc\.comm\.extension\.build_ext"):
        megatron_lm.configure(megatron_args("--resireduce", "w"), training=fake_training)
    assert _originals(fake_training) == before


# ------------------------------------------------------------------------------------- hooks, end to end


def test_attach_runs_once_with_the_built_model_and_optimizer(fake_training, recording):
    args = megatron_args("--gact-level", "L1")
    session = megatron_lm.configure(args, training=fake_training)
    assert session is megatron_lm.current_session() and session.names == ["gact"]
    assert recording.events == []  # nothing happens before Megatron has a model

    model, optimizer, scheduler = fake_training.setup_model_and_optimizer("encoder_or_decoder")
    assert (optimizer, scheduler) == ("megatron-optimizer", "scheduler")
    ctx = recording.ctx
    assert ctx.args is args and ctx.optimizer == "megatron-optimizer"
    assert ctx.ddp_model == model and ctx.model == [model[0].module]  # unwrapped through .module
    assert ctx.config is model[0].module.config
    assert recording.built == [(args, model[0].module.config)]
    assert recording.events == [("setup",)]
    assert fake_training.optimizer_builds == ["opt-config"]  # Megatron's own optimizer without --adama


def test_train_step_calls_the_hooks_around_every_microbatch(fake_training, recording):
    megatron_lm.configure(megatron_args("--gact-level", "L1"), training=fake_training)
    model, optimizer, scheduler = fake_training.setup_model_and_optimizer("encoder_or_decoder")
    recording.events.clear()

    result = fake_training.train_step(forward_step, iter([]), model, optimizer, scheduler, None, None,
                                      iteration=4)
    assert result[0]["lm loss"].item() == 2.5
    assert recording.events == [("begin", 5), ("enter",), ("exit",), ("enter",), ("exit",), ("end", 5, 2.5)]
    # Backward ran after forward_step returned, outside the context, yet used the context's unpack hook.
    assert recording.packed > 0 and recording.unpacked == recording.packed
    assert model[0].module.weight.grad is not None


def test_the_wrapped_forward_step_keeps_its_signature(fake_training, recording):
    """Megatron's schedules inspect forward_step_func's parameters; the wrapper must not change them."""
    megatron_lm.configure(megatron_args("--gact-level", "L1"), training=fake_training)
    model, optimizer, scheduler = fake_training.setup_model_and_optimizer("encoder_or_decoder")
    fake_training.train_step(forward_step, None, model, optimizer, scheduler, None, None, iteration=0)
    assert fake_training.seen_forward_step is not forward_step
    assert inspect.signature(fake_training.seen_forward_step) == inspect.signature(forward_step)


def test_ranks_without_a_loss_report_nan(recording):
    training = make_fake_training(num_microbatches=1, losses={})
    megatron_lm.configure(megatron_args("--gact-level", "L1"), training=training)
    model, optimizer, scheduler = training.setup_model_and_optimizer("encoder_or_decoder")
    training.train_step(forward_step, None, model, optimizer, scheduler, None, None, iteration=0)
    assert recording.events[-1] == ("end", 1, None)


def test_configure_twice_wraps_once_and_uninstall_restores(fake_training, recording):
    originals = _originals(fake_training)
    megatron_lm.configure(megatron_args("--gact-level", "L1"), training=fake_training)
    wrapped = _originals(fake_training)
    megatron_lm.configure(megatron_args("--gact-level", "L1"), training=fake_training)
    assert _originals(fake_training) == wrapped
    assert fake_training.train_step.__wrapped__ is originals["train_step"]
    assert fake_training.get_megatron_optimizer is originals["get_megatron_optimizer"]  # only for --adama
    megatron_lm.uninstall_training_hooks(fake_training)
    assert _originals(fake_training) == originals


def test_wrappers_pass_through_when_no_session_is_active(fake_training, recording):
    megatron_lm.configure(megatron_args("--gact-level", "L1"), training=fake_training)
    megatron_lm.reset()
    model, optimizer, scheduler = fake_training.setup_model_and_optimizer("encoder_or_decoder")
    fake_training.train_step(forward_step, None, model, optimizer, scheduler, None, None, iteration=0)
    assert recording.events == [] and fake_training.seen_forward_step is forward_step


def test_attach_can_be_called_directly(recording):
    """For custom training scripts: attach() alone builds and sets up the extensions."""
    model = [torch.nn.Linear(2, 2)]
    model[0].config = "cfg"
    assert megatron_lm.attach(model, "opt", megatron_args()) == []  # nothing enabled
    extensions = megatron_lm.attach(model, "opt", megatron_args("--gact-level", "L1"))
    assert extensions == [recording] and recording.ctx.config == "cfg"
    with pytest.raises(RuntimeError, match="already attached"):
        megatron_lm.current_session().attach(model, "opt")


def test_the_gradient_probe_replays_one_held_out_batch(fake_training, recording):
    """GACT's TrainingContext.forward_backward inside Megatron-LM's loop."""
    probes = []

    def probing_begin(iteration):
        weight = recording.ctx.model[0].weight
        weight.grad = None
        probes.append((recording.ctx.forward_backward(), weight.grad.clone()))
        probes.append((recording.ctx.forward_backward(), None))

    recording.on_step_begin = probing_begin
    megatron_lm.configure(megatron_args("--gact-level", "L1"), training=fake_training)
    model, optimizer, scheduler = fake_training.setup_model_and_optimizer("encoder_or_decoder")
    with pytest.raises(RuntimeError, match="inside a training step"):
        recording.ctx.forward_backward()

    batches = iter([torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.full((4,), 10.0), torch.full((4,), 20.0)])
    fake_training.train_step(batch_forward_step, batches, model, optimizer, scheduler, None, None, iteration=0)
    # weight = 0.5 everywhere: the first batch's per-token loss is (1+2+3+4) * 0.5 / 2 = 2.5, twice (replayed);
    # its gradient is batch / 2. The two training micro-batches then drew the next two batches.
    assert [p[0] for p in probes] == [2.5, 2.5]
    assert torch.equal(probes[0][1], torch.tensor([0.5, 1.0, 1.5, 2.0]))
    assert next(batches, None) is None
    assert model[0].no_sync_entered == 2  # probes keep gradients local: no bucket reduction starts


def test_the_probe_runs_pretrain_gpts_loss_checks_outside_rerun_bookkeeping(fake_training, recording):
    """pretrain_gpt.py's loss function calls the rerun state machine's validate_result, which asserts it runs
    inside a step's forward-backward pass (mode validate_results, Megatron-LM's default). The probe's pass is
    not one: the machine is disabled for it, still refusing NaN, and its mode is put back."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    machine = get_rerun_state_machine()
    before = machine.get_mode()
    machine.set_mode(RerunMode.VALIDATE_RESULTS)
    seen = []

    def checked_forward_step(data_iterator, model, return_schedule_plan: bool = False):
        output, loss_func = batch_forward_step(data_iterator, model)

        def checked(out):
            machine.validate_result(result=out, rejection_func=torch.isnan, message="NaN", tolerance=0.0,
                                    fatal=True)
            return loss_func(out)

        return output, checked

    try:
        megatron_lm.configure(megatron_args("--gact-level", "L1"), training=fake_training)
        model, _, _ = fake_training.setup_model_and_optimizer("encoder_or_decoder")
        with pytest.raises(AssertionError, match="outside of the forward-backward pass"):
            checked_forward_step(iter([torch.ones(4)]), model[0])[1](torch.tensor(1.0))  # outside the probe
        session = megatron_lm.current_session()
        session._step = (checked_forward_step, iter([torch.ones(4)]), model)  # as train_step's wrapper sets it
        seen.append((session.probe_forward_backward(), machine.get_mode()))
    finally:
        machine.set_mode(before)
    assert seen == [(1.0, RerunMode.VALIDATE_RESULTS)]


@pytest.mark.parametrize("level, env, shown", [(None, None, True), (30, None, False), (None, "40", False),
                                               (20, "40", True)])
def test_our_lines_follow_megatron_lms_logging_level(fake_training, recording, capsys, monkeypatch, level, env,
                                                     shown):
    """``--logging-level`` (else ``$MEGATRON_LOGGING_LEVEL``, Megatron-LM's own precedence) sets what
    megatron-adacc prints in ``pretrain_gpt.py``; its lines go to stderr, through the package logger."""
    if env is not None:
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", env)
    args = megatron_args("--gact-level", "L1", logging_level=level)
    megatron_lm.configure(args, training=fake_training)
    fake_training.setup_model_and_optimizer("encoder_or_decoder")
    err = capsys.readouterr().err
    assert ("[adacc] enabled gact; extensions: recording" in err) is shown, err
