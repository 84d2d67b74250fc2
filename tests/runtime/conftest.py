"""Fixtures shared by the runtime tests: a batch, and megatron-core left unpatched after every test.

Decision and comparison helpers live in ``_runtime_helpers.py``.
"""

from __future__ import annotations

import pytest

import megatron_adacc
from megatron_adacc.testing import tiny_batch


@pytest.fixture(scope="module")
def batch():
    return tiny_batch()


@pytest.fixture(autouse=True)
def _uninstall_after():
    """Every test leaves megatron-core unpatched, whatever it installed."""
    yield
    megatron_adacc.uninstall()
