"""Shared pytest set-up: quiet megatron's fallback notices, keep torch to one thread per xdist worker, and cap
every test's address space (one Megatron configuration recurses without bound; see megatron_adacc.testing)."""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

from megatron_adacc.compat import quiet_fallback_warnings  # noqa: E402
from megatron_adacc.testing import memory_cap  # noqa: E402

quiet_fallback_warnings()

#: Address-space cap per test. Generous for tiny models, small enough to stop a runaway recursion quickly.
TEST_MEMORY_CAP_GIB = float(os.environ.get("ADACC_TEST_MEMORY_CAP_GIB", "10"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` first, the rest in their order: xdist hands out tests in collection order, and one
    that runs for minutes collected late left the other worker idle to the end (an eight-minute test at 98% of
    the suite held CI's main tier for its last seven minutes)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True)
def _cap_memory():
    with memory_cap(TEST_MEMORY_CAP_GIB):
        yield


@pytest.fixture(autouse=True)
def _library_logging():
    """Each test starts as a program that imports the package: no handler on its logger. A test that runs
    ``adacc`` in-process installs one (and may pick -q); it must not leak into the next test."""
    from megatron_adacc.core import log

    log.uninstall()
    yield
    log.uninstall()


@pytest.fixture
def adacc_log():
    """The handler ``adacc`` installs, for tests that read its lines from captured standard error."""
    from megatron_adacc.core import log

    return log.install()
