"""docs/ARCHITECTURE.md's worked example, run: a fourth feature joins both hosts through its registry entry
alone, with nothing else changed."""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from megatron_adacc import features
from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.core.extension import TrainingExtension
from megatron_adacc.core.features import Feature, saved_tensor_hook_problems
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
         "--no-progress"]


class OffloadExtension(TrainingExtension):
    name = "offload"

    def __init__(self):
        self.microbatches = 0

    def microbatch_context(self):
        self.microbatches += 1
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())

    def report(self):
        return {"microbatches": self.microbatches}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offload-activations", action="store_true", help="Keep saved activations on the host.")


OFFLOAD = Feature(name="offload", flag="--offload-activations", dest="offload_activations", off=False,
                  add_args=add_args, build_extensions=lambda args, config: [OffloadExtension()],
                  problems=lambda args: saved_tensor_hook_problems("--offload-activations", args),
                  conflicts={"adacc": "--offload-activations and --adacc-policy both own the saved-tensor hooks"},
                  flag_prefixes=("--offload-",))


@pytest.fixture
def registered(monkeypatch):
    """The one registry line."""
    monkeypatch.setattr(features, "FEATURES", (*features.FEATURES, OFFLOAD))


def test_adacc_train_runs_the_new_feature(registered):
    stock = train(parse_train_args(SMALL))
    offloaded = train(parse_train_args(SMALL + ["--offload-activations"]))
    assert offloaded["extensions"]["offload"] == {"microbatches": 6}  # 3 steps x 2 micro-batches
    assert offloaded["losses"] == stock["losses"]  # host memory holds the same values: bit-identical training


def test_its_conflict_is_refused_by_the_host(registered):
    with pytest.raises(IntegrationError, match="both own the saved-tensor hooks"):
        train(parse_train_args(SMALL + ["--offload-activations", "--adacc-policy", "keep"]))


def test_megatron_lm_parses_and_configures_it(registered):
    from megatron_adacc import megatron_lm

    def setup_model_and_optimizer(*args, **kwargs):
        model = torch.nn.Linear(2, 2)
        model.config = "config"
        return [model], "optimizer", "scheduler"

    def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, iteration=0):
        return {}, False

    def save_checkpoint(iteration, *args, **kwargs):
        pass

    training = types.ModuleType("fake_training")
    training.setup_model_and_optimizer, training.train_step = setup_model_and_optimizer, train_step
    training.save_checkpoint = save_checkpoint
    args = megatron_lm.extra_args_provider(None)(argparse.ArgumentParser()).parse_args(["--offload-activations"])
    try:
        session = megatron_lm.configure(args, training=training)
        training.setup_model_and_optimizer()
        assert session.names == ["offload"] and [e.name for e in session.extensions] == ["offload"]
    finally:
        megatron_lm.reset()


def test_without_the_line_the_flag_does_not_exist():
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        parse_train_args(SMALL + ["--offload-activations"])
