"""Compatibility with the megatron-core releases we support, and with CPU-only machines."""

import warnings

from megatron_adacc.compat.versions import (
    SUPPORTED_LINES,
    UnsupportedMegatronVersion,
    is_line,
    megatron_line,
    megatron_version,
)

__all__ = [
    "SUPPORTED_LINES",
    "UnsupportedMegatronVersion",
    "is_line",
    "megatron_line",
    "megatron_version",
]


def quiet_fallback_warnings() -> None:
    """Silence megatron-core's import-time notices that apex / transformer-engine are absent.

    They are expected on CPU machines and in our GPU image alike, and they drown the progress bar. Real
    warnings (anything else megatron says) stay visible.
    """
    for pattern in (r".*are not installed\. Falling back.*", r".*is not installed\. Falling back.*",
                    r"full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
