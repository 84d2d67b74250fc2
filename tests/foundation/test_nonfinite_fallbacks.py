"""NaN/Inf activations kept uncompressed are told as they happen (rank 0, once a step at most, rate-limited,
with where and how many so far), not only in the summary at the end of the run."""

from __future__ import annotations

import pytest
import torch

from megatron_adacc.core import saved
from megatron_adacc.core.saved import NonFiniteFallbacks, SavedTensorStore
from megatron_adacc.training import loop
from megatron_adacc.training.args import parse_train_args

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
         "--no-progress"]


def _told(err: str) -> list[str]:
    return [line for line in err.splitlines() if "kept uncompressed" in line]


def test_the_first_fallback_of_a_step_is_told_with_the_count_so_far(capsys):
    fallbacks = NonFiniteFallbacks(interval_s=0)
    fallbacks.begin_step(4)
    fallbacks.note("layer 1, op fc1")
    fallbacks.note("layer 2, op fc1")
    fallbacks.begin_step(5)
    fallbacks.note("layer 1, op qkv")
    lines = _told(capsys.readouterr().err)
    assert len(lines) == 2 and fallbacks.total == 3
    assert lines[0].startswith("[adacc] iteration 4: NaN/Inf in a saved activation (layer 1, op fc1), kept")
    assert "; 1 so far this run" in lines[0] and "; 3 so far this run" in lines[1]


def test_lines_are_rate_limited_and_only_rank_0_tells(capsys, monkeypatch):
    fallbacks = NonFiniteFallbacks(interval_s=3600)
    for step in (1, 2, 3):
        fallbacks.begin_step(step)
        fallbacks.note("x")
    assert len(_told(capsys.readouterr().err)) == 1 and fallbacks.total == 3
    monkeypatch.setattr(saved, "_rank", lambda: 1)
    quiet = NonFiniteFallbacks(interval_s=0)
    quiet.note("x")
    assert _told(capsys.readouterr().err) == [] and quiet.total == 1


class _Refusing(SavedTensorStore):
    fallback_errors = (ValueError,)
    site = "layer 3"

    def compress(self, t, *context):
        if not torch.isfinite(t).all():
            raise ValueError("NaN/Inf")
        return None


def test_a_store_names_its_site_the_op_and_the_tensor(capsys, monkeypatch):
    monkeypatch.setattr(saved, "NONFINITE", NonFiniteFallbacks(interval_s=0))
    store = _Refusing()
    bad = torch.full((4, 8), float("nan"))
    assert store.store_tensor(bad, "fc1", True) is bad and store.fallbacks == 1
    assert "NaN/Inf in a saved activation (layer 3, op fc1, float32 4x8), kept" in capsys.readouterr().err


@pytest.fixture
def nan_embedding_at_step_2(monkeypatch):
    """The embedding's output is NaN in iteration 2, as an overflow would make it: every layer saves NaN."""
    real = loop._forward_loss

    def forward_loss(model, batch):
        if saved.NONFINITE.step != 2:
            return real(model, batch)
        embedding = next(m for name, m in model.named_modules() if name.endswith("embedding"))
        handle = embedding.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            return real(model, batch)
        finally:
            handle.remove()

    monkeypatch.setattr(loop, "_forward_loss", forward_loss)


def test_training_tells_the_step_the_values_went_bad(nan_embedding_at_step_2, capsys):
    from megatron_adacc.adacc.integration import uninstall

    try:
        summary = loop.train(parse_train_args(SMALL + ["--adacc-policy", "quantize-all"]))
    finally:
        uninstall()
    lines = _told(capsys.readouterr().err)
    assert len(lines) == 1, lines  # many tensors, one step: one line
    assert lines[0].startswith("[adacc] iteration 2: NaN/Inf in a saved activation (layer 1, op ")
    assert summary["nonfinite_fallbacks"] > 1  # every compressed tensor of the step, in the summary too
