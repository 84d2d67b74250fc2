"""What the running host offers features beyond the extension protocol.

Some answers only the host can give, before the model exists: ``--adacc-policy auto`` on the CPU needs the
process memory a training run holds outside its tensors, which only a real run of the user's own command shows.
The host that runs (``adacc train``) sets itself here for the run; a host that cannot answer (Megatron-LM's
script, a custom loop) leaves the default, and the feature falls back to what it can measure itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Host:
    """The default: a host that runs nothing on a feature's behalf."""

    name = "none"
    runs_training = False
    """Whether :meth:`measure_run` can answer."""

    def measure_run(self, args: Any, env: dict[str, str] | None = None, **overrides: Any) -> dict | None:
        """A short training run of this host with ``args`` changed by ``overrides``, run in a process of its own
        with ``env`` added to its environment: ``{"peak_memory_bytes": N, "extensions": {name: report}}``; None
        where the host cannot run one."""
        return None


_CURRENT: list[Host] = [Host()]


def current() -> Host:
    """The host running now."""
    return _CURRENT[-1]


@contextlib.contextmanager
def running(host: Host) -> Iterator[Host]:
    """Make ``host`` :func:`current` while the block runs."""
    _CURRENT.append(host)
    try:
        yield host
    finally:
        _CURRENT.remove(host)


def install(host: Host) -> None:
    """Make ``host`` :func:`current` for the rest of the process (a host whose entry point is not ours to wrap:
    Megatron-LM's script); installing one of the same class again changes nothing."""
    if type(_CURRENT[-1]) is not type(host):
        _CURRENT.append(host)


def uninstall(kind: type[Host]) -> None:
    """Undo :func:`install` for hosts of class ``kind`` (a session that is forgotten)."""
    _CURRENT[1:] = [h for h in _CURRENT[1:] if type(h) is not kind]  # the process's own host stays
