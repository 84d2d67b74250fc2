"""Shared set-up of the planner's tests: megatron's world of one, and `adacc train`'s tiny model as arguments and
a ``TransformerConfig``."""

from __future__ import annotations

import pytest
import torch

from megatron_adacc.testing import init_distributed_single


def tiny(num_layers: int):
    """(args, config) of `adacc train`'s tiny model with ``num_layers`` layers, hidden 64, 32 tokens, micro-batch 2."""
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args

    init_distributed_single()
    args = parse_train_args(["--config", "tiny", "--device", "cpu", "--num-layers", str(num_layers), "--hidden-size",
                             "64", "--ffn-hidden-size", "256", "--seq-length", "32", "--micro-batch-size", "2"])
    return args, model_lib.transformer_config(args, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny2():
    return tiny(2)


@pytest.fixture(scope="module")
def tiny4():
    return tiny(4)
