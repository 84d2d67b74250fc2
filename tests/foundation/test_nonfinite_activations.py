"""NaN/Inf in a saved activation: flagged on the device by the codec (no host read), told once the step is over
(rank 0, once a step at most, rate-limited, naming layer and op, with the counts), and never silently trained on:
the tensor decompresses with a NaN and the step is refused like a NaN loss, so no NaN reaches a checkpoint."""

from __future__ import annotations

import pytest
import torch

from megatron_adacc.core import saved
from megatron_adacc.core.saved import NonFiniteActivations, SavedTensorStore
from megatron_adacc.training import checkpoint, loop
from megatron_adacc.training.args import parse_train_args

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
         "--no-progress"]


def _told(err: str) -> list[str]:
    return [line for line in err.splitlines() if "NaN/Inf in a saved activation" in line]


def _settle(watch: NonFiniteActivations) -> None:
    vector, taken = watch.take()
    watch.settle(taken, vector.tolist())


def _flag(bad: bool) -> torch.Tensor:
    return torch.tensor([int(bad)], dtype=torch.int32)


def test_the_first_flagged_tensor_of_a_step_is_told_with_the_counts(caplog):
    watch = NonFiniteActivations(interval_s=0)
    watch.begin_step(4)
    for bad, where in [(False, "layer 1, op qkv"), (True, "layer 1, op fc1"), (True, "layer 2, op fc1")]:
        watch.note(_flag(bad), where)
    assert "NaN/Inf" not in caplog.text  # noted, not read: nothing is known before the step's end
    _settle(watch)
    watch.begin_step(5)
    watch.note(_flag(True), lambda: "layer 1, op qkv")  # places may be formatted only when told
    _settle(watch)
    lines = _told(caplog.text)
    assert len(lines) == 2 and watch.total == 3
    assert "iteration 4: NaN/Inf in a saved activation (layer 1, op fc1)" in lines[0]
    assert "2 such tensor(s) this step, 2 this run" in lines[0] and "1 such tensor(s) this step, 3 this run" in lines[1]


def test_lines_are_rate_limited_and_only_rank_0_tells(caplog, monkeypatch):
    watch = NonFiniteActivations(interval_s=3600)
    for step in (1, 2, 3):
        watch.begin_step(step)
        watch.note(_flag(True), "x")
        _settle(watch)
    assert len(_told(caplog.text)) == 1 and watch.total == 3
    caplog.clear()
    monkeypatch.setattr(saved, "_rank", lambda: 1)
    quiet = NonFiniteActivations(interval_s=0)
    quiet.note(_flag(True), "x")
    _settle(quiet)
    assert _told(caplog.text) == [] and quiet.total == 1


def test_a_step_with_nothing_noted_or_nothing_flagged(caplog):
    watch = NonFiniteActivations(interval_s=0)
    assert watch.take() is None and watch.clean() is None
    watch.note(_flag(False), "x")
    assert bool(watch.clean())
    _settle(watch)
    assert (watch.last_step, watch.total) == (0, 0) and _told(caplog.text) == []


def test_many_notes_are_kept_in_few_tensors_and_past_the_cap_merged(monkeypatch):
    monkeypatch.setattr(NonFiniteActivations, "MAX_NOTES", 600)
    watch = NonFiniteActivations(interval_s=0)
    for i in range(700):
        watch.note(_flag(i in (3, 650)), f"#{i}")
    assert len(watch._chunks) == 2 and len(watch._flags) == 600 - 2 * NonFiniteActivations.CHUNK
    vector, taken = watch.take()
    assert vector.numel() == 601  # 600 named, then one merged flag for the 100 past the cap
    watch.settle(taken, vector.tolist())
    assert watch.last_step == 2


class _Flagging(SavedTensorStore):
    site = "layer 3"

    def compress(self, t, *context):
        self.note_nonfinite((~torch.isfinite(t)).any().to(torch.int32), t, *context)
        return None


def test_a_store_names_its_site_the_op_and_the_tensor(caplog, monkeypatch):
    watch = NonFiniteActivations(interval_s=0)
    monkeypatch.setattr(saved, "NONFINITE", watch)
    _Flagging().store_tensor(torch.full((4, 8), float("nan")), "fc1", True)
    _settle(watch)
    assert "NaN/Inf in a saved activation (layer 3, op fc1, float32 4x8)" in caplog.text


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


def test_training_names_layer_and_op_skips_the_step_and_saves_no_nan(nan_embedding_at_step_2, caplog, tmp_path):
    from megatron_adacc.adacc.integration import uninstall

    try:
        summary, model = loop.train(parse_train_args(SMALL + ["--adacc-policy", "quantize-all", "--save",
                                                              str(tmp_path), "--save-interval", "1"]),
                                    return_model=True)
    finally:
        uninstall()
    lines = _told(caplog.text)
    assert len(lines) == 1, lines  # many tensors, one step: one line
    assert "iteration 2: NaN/Inf in a saved activation (layer 1, op " in lines[0]
    assert summary["nonfinite_activations"] > 1  # every compressed tensor of the step, in the summary too
    assert "iteration 2: step skipped" in caplog.text
    assert torch.isfinite(torch.tensor(summary["losses"][2]))  # the next step trains on
    state = torch.load(checkpoint.paths(tmp_path, 0)[0], weights_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in [*state["model"].values(), *model.state_dict().values()]
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def test_the_floor_through_megatron_s_checkpoint_names_the_layer_input(nan_embedding_at_step_2, caplog, tmp_path):
    """A layer compressing its input and recomputing the rest runs megatron's checkpoint, whose saved input the
    codec packs: a NaN there is told under the layer and op ``layer_input``, as the decomposition tells it."""
    from megatron_adacc.adacc.integration import uninstall
    from megatron_adacc.adacc.policy.io import save_policy
    from megatron_adacc.adacc.policy.ops import OP_NAMES
    from megatron_adacc.adacc.policy.policy import Policy

    floor = Policy.uniform({name: "recompute" for name in OP_NAMES[1:]} | {"layer_input": "compress"}, 2)
    path = save_policy(floor, tmp_path / "floor.json")
    try:
        summary = loop.train(parse_train_args(SMALL + ["--adacc-policy", str(path)]))
    finally:
        uninstall()
    lines = _told(caplog.text)
    assert len(lines) == 1 and "iteration 2: NaN/Inf in a saved activation (layer 1, op layer_input, " in lines[0]
    assert summary["nonfinite_activations"] == 4  # one input per layer and micro-batch, nothing else stored
    assert "iteration 2: step skipped" in caplog.text
