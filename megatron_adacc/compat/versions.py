"""Which megatron-core releases this package knows, and one place that says so.

Our Megatron integration patches private internals (the full-recompute entry point, DDP bucket reduction,
optimizer helpers). Those move between releases, so every patch asks this module which line it is on and
refuses a release nobody has checked instead of failing somewhere deep inside a training step.
"""

from __future__ import annotations

import os
from functools import lru_cache

from megatron_adacc.core.errors import AdaccError

#: Release lines whose internals our patches were written against. 0.16 is the newest line that installs on
#: Python 3.11; 0.17 and later need Python 3.12, and 0.19 is the line our GPU images use.
SUPPORTED_LINES: dict[tuple[int, int], str] = {
    (0, 16): "0.16 (Python 3.10/3.11; TransformerBlock._checkpointed_forward)",
    (0, 19): "0.19 (Python 3.12; megatron.core.recompute.checkpointed_forward)",
    (0, 20): "0.20 (Megatron-LM main pinned in patches/; same entry points as 0.19)",
}

#: Set to 1 to try a megatron-core release outside SUPPORTED_LINES at your own risk.
ALLOW_UNTESTED_ENV = "ADACC_ALLOW_UNTESTED_MEGATRON"


class UnsupportedMegatronVersion(AdaccError, RuntimeError):
    """Raised when the installed megatron-core is a release our patches were not written for."""


@lru_cache(maxsize=1)
def megatron_version() -> str:
    """The installed megatron-core version string, e.g. ``"0.16.1"``."""
    try:  # here, not at the top: compat is imported to quiet megatron-core's warnings before it loads
        import megatron.core
    except ImportError as exc:  # pragma: no cover - the dependency is declared
        raise UnsupportedMegatronVersion(
            "megatron-core is not installed: `pip install 'megatron-core>=0.16.1'`"
        ) from exc
    return str(megatron.core.__version__)


def parse_line(version: str) -> tuple[int, int]:
    """``"0.16.1"`` -> ``(0, 16)``; ``"0.19.0rc1"`` -> ``(0, 19)``."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()))
    except (IndexError, ValueError) as exc:
        raise UnsupportedMegatronVersion(f"cannot parse megatron-core version {version!r}") from exc


def megatron_line(version: str | None = None) -> tuple[int, int]:
    """The release line of ``version`` (default: the installed one), checked against SUPPORTED_LINES."""
    version = version or megatron_version()
    line = parse_line(version)
    if line not in SUPPORTED_LINES and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_LINES)
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is not a release megatron-adacc supports (supported: {known}). "
            f"Install a supported release (e.g. `pip install megatron-core==0.16.1` on Python 3.11), "
            f"or set {ALLOW_UNTESTED_ENV}=1 to try it anyway."
        )
    return line


def is_line(major: int, minor: int, version: str | None = None) -> bool:
    """True when ``version`` (default: installed) belongs to release line ``major.minor`` or later."""
    return parse_line(version or megatron_version()) >= (major, minor)
