"""Fixtures shared by the runtime tests: a model and a batch, and megatron-core left unpatched after every test.

Decision and comparison helpers live in ``_runtime_helpers.py``.
"""

from __future__ import annotations

import pytest

import megatron_adacc
from megatron_adacc.testing import build_tiny_gpt, tiny_batch


@pytest.fixture(scope="module")
def model():
    """megatron-core's GPTModel, 2 tiny layers with dropout on, in training mode (one per test module)."""
    m = build_tiny_gpt(seed=5)
    m.train()
    return m


@pytest.fixture(scope="module")
def batch():
    return tiny_batch()


@pytest.fixture(autouse=True)
def _uninstall_after():
    """Every test leaves megatron-core unpatched, whatever it installed."""
    yield
    megatron_adacc.uninstall()
