"""Fixtures for the Megatron-LM integration tests (the fakes live in megatron_lm_fakes.py)."""

from __future__ import annotations

import pytest
from megatron_lm_fakes import make_fake_training

from megatron_adacc import megatron_lm


@pytest.fixture(autouse=True)
def _fresh_session():
    megatron_lm.reset()
    yield
    megatron_lm.reset()


@pytest.fixture
def fake_training():
    return make_fake_training()
