"""A NaN/Inf step never poisons the weights or a checkpoint: ``--on-nonfinite skip`` (default) or ``stop``."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_adacc.training import checkpoint, loop
from megatron_adacc.training.args import MAX_CONSECUTIVE_SKIPS, parse_train_args

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--no-progress"]
MICRO_PER_STEP = 2


@pytest.fixture
def inf_at(monkeypatch):
    """Make the forward loss Inf at the given 1-based iterations (first micro-batch), as a bad batch would."""
    calls = {"n": 0}
    iterations: set[int] = set()
    real = loop._forward_loss

    def forward_loss(ddp, batch):
        calls["n"] += 1
        loss = real(ddp, batch)
        iteration = (calls["n"] - 1) // MICRO_PER_STEP + 1
        first_micro = (calls["n"] - 1) % MICRO_PER_STEP == 0
        return loss * float("inf") if iteration in iterations and first_micro else loss

    monkeypatch.setattr(loop, "_forward_loss", forward_loss)
    return iterations


def _all_finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in module.state_dict().values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def test_skip_leaves_weights_and_checkpoints_finite(tmp_path, inf_at, capsys, adacc_log):
    inf_at.add(3)
    summary, model = loop.train(parse_train_args(SMALL + ["--train-iters", "5", "--save", str(tmp_path),
                                                          "--save-interval", "1"]), return_model=True)
    losses = summary["losses"]
    assert not torch.isfinite(torch.tensor(losses[2])) and all(torch.isfinite(torch.tensor(losses[3:])))
    assert _all_finite(model)
    assert "[adacc] WARNING: iteration 3: step skipped" in capsys.readouterr().err
    state = torch.load(checkpoint.paths(tmp_path, 0)[0], weights_only=True)
    assert state["iteration"] == 5 and all(bool(torch.isfinite(t).all()) for t in state["model"].values()
                                          if isinstance(t, torch.Tensor) and t.is_floating_point())


def test_stop_raises_and_keeps_the_last_good_checkpoint(tmp_path, inf_at):
    inf_at.add(3)
    args = parse_train_args(SMALL + ["--train-iters", "5", "--save", str(tmp_path), "--save-interval", "1",
                                     "--on-nonfinite", "stop"])
    with pytest.raises(loop.NonFiniteError, match="iteration 3: NaN/Inf .* nothing was saved"):
        loop.train(args)
    assert json.loads(checkpoint.paths(tmp_path, 0)[1].read_text())["iteration"] == 2


def test_adama_always_stops(inf_at):
    inf_at.add(2)
    with pytest.raises(loop.NonFiniteError, match="AdamA has already folded"):
        loop.train(parse_train_args(SMALL + ["--train-iters", "3", "--adama", "--clip-grad", "0"]))


def test_a_run_that_keeps_failing_stops(inf_at):
    inf_at.update(range(2, 2 + MAX_CONSECUTIVE_SKIPS))
    with pytest.raises(loop.NonFiniteError, match=f"{MAX_CONSECUTIVE_SKIPS} steps in a row"):
        loop.train(parse_train_args(SMALL + ["--train-iters", str(2 + MAX_CONSECUTIVE_SKIPS)]))
