"""Shared fixtures for the GACT tests: the codec library's real ``stochastic`` and ``bitmask`` codecs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def codec_factory():
    """``megatron_adacc.codecs.get_codec`` (what the controller uses by default), passed explicitly so a
    test documents which codecs it runs."""
    from megatron_adacc.codecs import get_codec

    return get_codec


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
