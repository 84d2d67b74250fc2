"""Feature state beside Megatron-LM's checkpoints: what is written, what is read back, what is refused."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from megatron_lm_fakes import forward_step, make_fake_training, megatron_args

from megatron_adacc import megatron_lm
from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.extension import TrainingExtension
from megatron_adacc.megatron_lm import checkpoints
from megatron_adacc.megatron_lm import session as session_mod


class Stateful(TrainingExtension):
    def __init__(self, name: str, value: float = 0.0) -> None:
        self.name = name
        self.residual = torch.full((3,), value)
        self.loaded = None

    def state_dict(self) -> dict:
        return {"residual": self.residual.clone(), "note": "kept", "steps": [1, 2]}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state
        self.residual = state["residual"].clone()


def test_round_trip_per_rank_with_host_state(tmp_path):
    saved = [Stateful("resireduce", 1.5), Stateful("gact", -2.0)]
    path = checkpoints.save(saved, tmp_path, 5, host={"probe_batch": {"tokens": torch.arange(4)}})
    assert path == tmp_path / "iter_0000005" / "megatron_adacc" / "rank00000.pt"
    fresh = [Stateful("resireduce"), Stateful("gact")]
    host = checkpoints.load(fresh, tmp_path, 5, log=pytest.fail)
    assert torch.equal(fresh[0].residual, torch.full((3,), 1.5))
    assert torch.equal(fresh[1].residual, torch.full((3,), -2.0))
    assert fresh[0].loaded["note"] == "kept" and fresh[0].loaded["steps"] == [1, 2]
    assert torch.equal(host["probe_batch"]["tokens"], torch.arange(4))
    assert not list(path.parent.glob("*.partial"))


def test_nothing_to_save_writes_nothing(tmp_path):
    class Stateless(TrainingExtension):
        name = "stateless"

    assert checkpoints.save([Stateless()], tmp_path, 3) is None
    assert not (tmp_path / "iter_0000003").exists()


def test_a_checkpoint_without_our_state_resumes_fresh_and_says_so(tmp_path):
    messages = []
    assert checkpoints.load([Stateful("resireduce")], tmp_path, 7, log=messages.append) == {}
    assert len(messages) == 1 and "resireduce start afresh" in messages[0] and "iteration 7" in messages[0]


def test_state_of_a_feature_not_enabled_now_is_ignored_by_name(tmp_path):
    checkpoints.save([Stateful("resireduce", 1.0), Stateful("gact", 2.0)], tmp_path, 2)
    messages = []
    only = Stateful("gact")
    checkpoints.load([only], tmp_path, 2, log=messages.append)
    assert torch.equal(only.residual, torch.full((3,), 2.0))
    assert len(messages) == 1 and "resireduce" in messages[0] and "ignored" in messages[0]


def test_a_truncated_file_is_one_clear_error(tmp_path):
    path = checkpoints.save([Stateful("gact", 1.0)], tmp_path, 4)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(checkpoints.CheckpointStateError, match="not a readable megatron-adacc state file") as info:
        checkpoints.load([Stateful("gact")], tmp_path, 4)
    assert isinstance(info.value, AdaccError) and "delete it" in str(info.value)


def test_another_format_is_refused(tmp_path):
    path = checkpoints.state_path(tmp_path, 4, 0)
    path.parent.mkdir(parents=True)
    torch.save({"format": checkpoints.FORMAT + 1, "extensions": {}}, path)
    with pytest.raises(checkpoints.CheckpointStateError, match=f"reads format {checkpoints.FORMAT}"):
        checkpoints.load([Stateful("gact")], tmp_path, 4)


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_loading_never_runs_code_from_the_file(tmp_path):
    marker = tmp_path / "code-ran"
    path = checkpoints.state_path(tmp_path, 1, 0)
    path.parent.mkdir(parents=True)
    torch.save({"format": checkpoints.FORMAT, "extensions": {"gact": _RunsCode(str(marker))}}, path)
    with pytest.raises(checkpoints.CheckpointStateError):
        checkpoints.load([Stateful("gact")], tmp_path, 1)
    assert not marker.exists()


# ------------------------------------------------------------------------------ through the session hooks


@pytest.fixture
def stateful_session(monkeypatch):
    extension = Stateful("recording-state", 4.0)
    monkeypatch.setattr(session_mod, "build_extensions", lambda features, args, config: [extension])
    megatron_lm.reset()
    yield extension
    megatron_lm.reset()


def _run(training, args):
    megatron_lm.configure(args, training=training)
    model, optimizer, _ = training.setup_model_and_optimizer("model-type")
    training.train_step(forward_step, iter(torch.randn(2, 4, 8).unbind(0)), model, optimizer, None, None, None,
                        iteration=0)
    return model, optimizer


def test_save_checkpoint_writes_our_state_and_setup_reads_it_back(tmp_path, stateful_session):
    training = make_fake_training()
    args = megatron_args("--adacc-policy", "keep", save=str(tmp_path), load=None, iteration=0)
    model, optimizer = _run(training, args)
    training.save_checkpoint(6, model, optimizer, None, 0)
    training.save_checkpoint(8, model, optimizer, None, 0, non_persistent_ckpt=True)  # local: Megatron's own
    assert ("save_checkpoint", 6, False) in training.calls
    assert checkpoints.state_path(tmp_path, 6, 0).is_file()
    assert not checkpoints.state_path(tmp_path, 8, 0).exists()

    stateful_session.residual = torch.zeros(3)
    resumed = make_fake_training()
    megatron_lm.reset()
    _run(resumed, megatron_args("--adacc-policy", "keep", save=str(tmp_path), load=str(tmp_path), iteration=6))
    assert torch.equal(stateful_session.residual, torch.full((3,), 4.0))


class _RerunLike:
    """What Megatron-LM's RerunDataIterator looks like from outside: it reads from ``.iterable``."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.iterable)


def test_the_gradient_probe_peeks_and_training_sees_the_same_stream():
    stream = _RerunLike(iter(range(10)))
    assert session_mod._peek(stream) == 0
    assert list(itertools.islice(stream, 3)) == [0, 1, 2]
    plain = iter(range(3))
    assert session_mod._peek(plain) == 0 and list(plain) == [1, 2]  # no .iterable: the item is used up
    assert session_mod._peek(None) is None


def test_probe_batch_travels_with_the_checkpoint():
    session = session_mod.Session(megatron_args("--adacc-policy", "keep"), [])
    assert session.host_state() == {}
    session.load_host_state({"probe_batch": {"tokens": torch.ones(2)}})
    assert torch.equal(session.host_state()["probe_batch"]["tokens"], torch.ones(2))
