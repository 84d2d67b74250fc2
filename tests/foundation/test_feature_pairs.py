"""Every two features of the registry train together, or are refused before anything is built with the reason
docs/feature-pairs.md gives: one case per pair, generated from the registry, so a new feature or a new
conflict cannot go untested."""

from __future__ import annotations

import math

import pytest

from megatron_adacc import features
from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.training import model as model_lib
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
         "--no-progress"]
#: The cheapest command line that turns each feature on and makes it do its work.
ON = {"adacc": ["--adacc-policy", "quantize-all"], "resireduce": ["--resireduce", "residual"],
      "gact": ["--gact-level", "L1"], "adama": ["--adama"]}
PAIRS = features.pairs()


@pytest.fixture(autouse=True)
def _uninstall():
    yield
    from megatron_adacc.adacc.integration import uninstall

    uninstall()


def test_every_feature_has_a_command_line_here():
    assert set(ON) == {f.name for f in features.FEATURES}, "add the new feature's flags to ON"


@pytest.mark.parametrize("pair", [p for p in PAIRS if p.refusal is None],
                         ids=lambda p: f"{p.first.name}+{p.second.name}")
def test_a_pair_that_works_trains(pair):
    summary = train(parse_train_args(SMALL + ON[pair.first.name] + ON[pair.second.name]))
    assert {pair.first.name, pair.second.name} <= set(summary["extensions"])
    assert summary["iterations"] == 2 and all(math.isfinite(loss) for loss in summary["losses"])


@pytest.mark.parametrize("pair", [p for p in PAIRS if p.refusal is not None],
                         ids=lambda p: f"{p.first.name}+{p.second.name}")
def test_a_refused_pair_is_refused_before_the_model_exists(pair, monkeypatch):
    def build_gpt(*args, **kwargs):
        raise AssertionError("the model was built before the pair was refused")

    monkeypatch.setattr(model_lib, "build_gpt", build_gpt)
    with pytest.raises(IntegrationError) as refused:
        train(parse_train_args(SMALL + ON[pair.first.name] + ON[pair.second.name]))
    assert pair.refusal in str(refused.value)
