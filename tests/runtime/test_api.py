"""The one-call Python API, ``megatron_adacc.install(model, policy, budget=..., ...)``, on a megatron-core GPT:
``auto`` profiles and solves from the model itself, presets and files behave as in the hosts, and mistakes are
told in the API's own words (its arguments, never the hosts' flags)."""

import dataclasses

import pytest
import torch
from _runtime_helpers import grads_equal

import megatron_adacc
from megatron_adacc.adacc.integration import dispatch as glue
from megatron_adacc.adacc.policy.io import save_policy
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.policy.signature import SignatureMismatchError
from megatron_adacc.testing import build_tiny_gpt, loss_and_grads


def test_keep_from_the_model_is_stock_megatron(model, batch):
    megatron_adacc.uninstall()
    reference = loss_and_grads(model, batch)
    assert megatron_adacc.install(model, "keep") == "keep"
    assert glue.is_installed()
    got = loss_and_grads(model, batch)
    assert torch.equal(got[0], reference[0]) and grads_equal(got[1], reference[1]) == []


def test_auto_solves_for_the_budget_from_the_model(model, batch, tmp_path):
    # A budget far below what keeping every activation of this model holds, so that `auto` must choose.
    policy = megatron_adacc.install(model, "auto", budget="4GiB", micro_batch_size=2, codec="none",
                                    profile_db=tmp_path / "profiles.sqlite")
    assert isinstance(policy, Policy) and policy.num_layers == 2
    assert glue.installed_policy() is policy
    assert policy.signature["seq_length"] == model.max_sequence_length
    assert policy.signature["micro_batch_size"] == 2
    assert policy.signature["vocab_size"] == model.vocab_size
    assert policy.signature["untie_embeddings_and_output_weights"] is not model.share_embeddings_and_output_weights
    assert (tmp_path / "profiles.sqlite").is_file()  # profiled once, kept for the next install
    loss, grads = loss_and_grads(model, batch)
    assert torch.isfinite(loss) and grads


def test_a_policy_file_made_for_another_micro_batch_is_refused(model, tmp_path):
    made_for_4 = dataclasses.replace(Policy.all_keep(2), signature=_signature(model, micro_batch_size=4))
    path = save_policy(made_for_4, tmp_path / "p.json")
    assert megatron_adacc.install(model, path, micro_batch_size=4).num_layers == 2
    with pytest.raises(SignatureMismatchError, match="micro_batch_size"):
        megatron_adacc.install(model, path, micro_batch_size=2)


@pytest.mark.parametrize("call,error,words", [
    (lambda m: megatron_adacc.install(m, "no/such.json"), FileNotFoundError,
     r"^policy='no/such.json' is neither 'auto', a preset"),
    (lambda m: megatron_adacc.install(m, "auto", budget="30Gx", micro_batch_size=2), ValueError,
     r"^budget='30Gx': cannot read"),
    (lambda m: megatron_adacc.install(m, "auto", budget="0", micro_batch_size=2), ValueError, r"^budget='0'"),
    (lambda m: megatron_adacc.install(m, "auto"), TypeError, r"needs micro_batch_size="),
    (lambda m: megatron_adacc.install(m, "keep", micro_batch_size=0), ValueError, r"^micro_batch_size=0 must"),
    (lambda m: megatron_adacc.install(m, "auto", micro_batch_size=2, codec="int8"), ValueError, r"^codec='int8'"),
    (lambda m: megatron_adacc.install(m, "auto", micro_batch_size=2, headroom=1.5), ValueError, r"^headroom=1.5"),
    (lambda m: megatron_adacc.install("keep"), TypeError, r"the first argument is the model"),
    (lambda m: megatron_adacc.install(m, 3), TypeError, r"^policy= takes"),
])
def test_mistakes_name_the_argument_and_install_nothing(model, call, error, words):
    megatron_adacc.uninstall()
    with pytest.raises(error, match=words) as raised:
        call(model)
    assert "--" not in str(raised.value)
    assert not glue.is_installed()


def _signature(model, **overrides):
    from types import SimpleNamespace

    from megatron_adacc.adacc.policy.signature import model_signature

    args = SimpleNamespace(seq_length=model.max_sequence_length, micro_batch_size=2, vocab_size=model.vocab_size,
                           untie_embeddings_and_output_weights=not model.share_embeddings_and_output_weights)
    return {**model_signature(model.config, args), **overrides}


def test_auto_leaves_the_callers_random_streams_as_they_were(tmp_path):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    config = build_tiny_gpt(seed=3).config
    torch.manual_seed(11)
    before = (torch.get_rng_state(), {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()})
    megatron_adacc.install(config, "auto", budget="4GiB", micro_batch_size=2, seq_length=32, codec="none",
                           profile_db=tmp_path / "profiles.sqlite")
    assert torch.equal(torch.get_rng_state(), before[0])
    after = get_cuda_rng_tracker().get_states()
    assert after.keys() == before[1].keys() and all(torch.equal(after[k], before[1][k]) for k in after)


def test_the_documented_example_runs(tmp_path):
    """examples/python_api.py, which README.md points to, trains as printed (a fresh profile database)."""
    import os
    import subprocess
    import sys

    from megatron_adacc.testing import REPO_ROOT

    env = {**os.environ, "ADACC_PROFILE_DB": str(tmp_path / "profiles.sqlite")}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "python_api.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "policy: " in run.stdout and "step 4: loss" in run.stdout
    assert "profiled" in run.stderr or "profil" in run.stderr  # auto said what it did, through logging
