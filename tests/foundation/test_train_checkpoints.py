"""``adacc train --save/--load``: exact resume with dropout on, and checkpoints that are checked before loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_adacc.training import checkpoint
from megatron_adacc.training.args import parse_train_args
from megatron_adacc.training.loop import train

REPO = Path(__file__).resolve().parents[2]
#: The tiny config keeps its dropout (0.1): resume must replay Megatron's RNG tracker streams too. A constant
#: learning rate makes 2 + 2 iterations the same schedule as 4 (a decay follows --train-iters).
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--no-progress",
         "--lr-warmup-iters", "0", "--lr", "3e-3", "--min-lr", "3e-3"]  # constant: 2 + 2 == 4 straight


@pytest.mark.parametrize("flags", [[], ["--adacc-policy", "quantize-all"], ["--adama", "--clip-grad", "0"],
                                   ["--gact-level", "L2", "--gact-adapt-interval", "1"]],
                         ids=["plain", "adacc-quantize-all", "adama", "gact"])
def test_resume_with_dropout_on_is_bit_exact(tmp_path, flags):
    straight = train(parse_train_args(SMALL + flags + ["--train-iters", "4"]))
    train(parse_train_args(SMALL + flags + ["--train-iters", "2", "--save", str(tmp_path)]))
    resumed = train(parse_train_args(SMALL + flags + ["--train-iters", "4", "--load", str(tmp_path)]))
    assert resumed["losses"] == straight["losses"][2:]


def test_resume_under_outlier_separated_int4_is_bit_exact(tmp_path):
    """The outlier codec stores as many channels as the previous step counted at each place (learned on the
    device, no host sync): those capacities are checkpointed, so the resumed run compresses as the straight one."""
    from megatron_adacc.adacc.policy.io import save_policy
    from megatron_adacc.adacc.policy.ops import OPS
    from megatron_adacc.adacc.policy.policy import Decision, Policy

    policy = Policy.uniform({op.name: Decision.compress(op.default_codec) for op in OPS}, 2)
    flags = ["--adacc-policy", str(save_policy(policy, tmp_path / "layer-codecs.json"))]
    straight = train(parse_train_args(SMALL + flags + ["--train-iters", "4"]))
    train(parse_train_args(SMALL + flags + ["--train-iters", "2", "--save", str(tmp_path / "ckpt")]))
    resumed = train(parse_train_args(SMALL + flags + ["--train-iters", "4", "--load", str(tmp_path / "ckpt")]))
    assert resumed["losses"] == straight["losses"][2:]


def test_a_stock_checkpoint_goes_on_under_adacc_and_back(tmp_path):
    """Adacc changes how activations are held, never the model's or the optimizer's state: a model pretrained
    stock goes on under a policy (keep-everything: bit for bit what stock would have done), and back."""
    straight = train(parse_train_args(SMALL + ["--train-iters", "6"]))
    train(parse_train_args(SMALL + ["--train-iters", "2", "--save", str(tmp_path / "stock")]))
    under = train(parse_train_args(SMALL + ["--adacc-policy", "keep", "--train-iters", "4", "--load",
                                            str(tmp_path / "stock"), "--save", str(tmp_path / "adacc")]))
    back = train(parse_train_args(SMALL + ["--train-iters", "6", "--load", str(tmp_path / "adacc")]))
    assert under["losses"] + back["losses"] == straight["losses"][2:]
    manifest = json.loads((tmp_path / "adacc" / "rank00000.json").read_text())
    assert manifest["features"] == [] and manifest["optional_features"] == ["adacc"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    train(parse_train_args(SMALL + ["--train-iters", "1", "--save", str(directory)]))
    return directory


def _copy(saved: Path, tmp_path: Path) -> Path:
    for name in ("rank00000.pt", "rank00000.json"):
        (tmp_path / name).write_bytes((saved / name).read_bytes())
    return tmp_path


def _resume(directory: Path, *flags: str):
    return train(parse_train_args(SMALL + list(flags) + ["--train-iters", "2", "--load", str(directory)]))


def test_the_manifest_names_what_the_checkpoint_is(saved):
    manifest = json.loads((saved / "rank00000.json").read_text())
    assert manifest["format"] == checkpoint.FORMAT and manifest["iteration"] == 1
    assert len(manifest["sha256"]) == 64 and manifest["features"] == []
    assert manifest["model"]["embedding.word_embeddings.weight"][1] == 64
    assert not [p for p in saved.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_flipped_bytes_are_refused(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    data = bytearray((directory / "rank00000.pt").read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    (directory / "rank00000.pt").write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="does not match its manifest's checksum"):
        _resume(directory)


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_crafted_checkpoint_cannot_run_code_even_with_a_matching_manifest(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    marker = tmp_path / "code-ran"
    torch.save({"iteration": 1, "model": _RunsCode(str(marker))}, directory / "rank00000.pt")
    manifest = json.loads((directory / "rank00000.json").read_text())
    manifest["sha256"] = checkpoint._sha256(directory / "rank00000.pt")  # the attacker controls both files
    (directory / "rank00000.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read safely"):
        _resume(directory)
    assert not marker.exists()


def test_a_checkpoint_of_another_model_is_refused_by_name(saved):
    with pytest.raises(checkpoint.CheckpointError, match=r"another model: \S+ is \[64\] there and \[96\] here"):
        _resume(saved, "--hidden-size", "96")  # the later flag wins


def test_adam_and_adama_checkpoints_do_not_load_into_each_other(saved):
    with pytest.raises(checkpoint.CheckpointError, match="saved with optimizer .* this run has .*AdamA"):
        _resume(saved, "--adama", "--clip-grad", "0")


def test_a_checkpoint_without_manifest_is_refused(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    (directory / "rank00000.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="rank00000.json is missing"):
        _resume(directory)


def test_the_cli_says_it_in_one_line(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    (directory / "rank00000.pt").write_bytes(b"not a checkpoint")
    out = subprocess.run([sys.executable, "-m", "megatron_adacc.cli", "train", *SMALL, "--train-iters", "2",
                          "--load", str(directory)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if "checksum" in line]
    assert len(lines) == 1 and "Traceback" not in out.stderr


def test_each_iteration_is_saved_at_most_once(tmp_path, monkeypatch):
    """The interval save of the last iteration is the final checkpoint too: not written twice."""
    from megatron_adacc.training import loop

    saved = []
    real = loop._save_checkpoint
    monkeypatch.setattr(loop, "_save_checkpoint", lambda d, run, it: (saved.append(it), real(d, run, it)))
    train(parse_train_args(SMALL + ["--train-iters", "3", "--save", str(tmp_path), "--save-interval", "1"]))
    assert saved == [1, 2, 3]
