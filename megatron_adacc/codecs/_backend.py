"""Which implementation runs the kernels: the compiled ``megatron_adacc._C`` or the pure-torch reference.

``ADACC_REQUIRE_EXT=1`` turns a missing or broken extension into an import error (CI sets it, so a build
problem cannot hide behind the slower reference). Without it, a missing extension falls back to
`megatron_adacc.codecs.reference` with a warning: results are identical, only slower.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from megatron_adacc.codecs import reference

_REQUIRE_ENV = "ADACC_REQUIRE_EXT"


def _load_extension() -> ModuleType | None:
    try:  # the compiled extension is optional: without it the codecs run on the reference
        from megatron_adacc import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        if os.environ.get(_REQUIRE_ENV, "") not in ("", "0"):
            raise ImportError(
                f"{_REQUIRE_ENV}=1 but the compiled codec extension megatron_adacc._C cannot be imported "
                f"({exc}). Build it with `pip install --no-build-isolation -e .` (or "
                "`python setup.py build_ext --inplace`) in an environment with torch installed."
            ) from exc
        warnings.warn(
            f"megatron_adacc._C is not built ({exc}); codecs run on the slower pure-torch reference. "
            "Build it with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return _C


_C = _load_extension()


def backend(device: torch.device | str | None = None) -> str:
    """The implementation codecs use: ``"cuda"``, ``"cpp"`` or ``"reference"``.

    With ``device`` given, the answer is for tensors on that device; without, for the default device of
    this process (CUDA when the extension has CUDA kernels and a GPU is visible, else CPU).
    """
    if _C is None:
        return "reference"
    if device is None:
        return "cuda" if (_C.with_cuda and torch.cuda.is_available()) else "cpp"
    dev = torch.device(device)
    if dev.type == "cuda":
        return "cuda" if _C.with_cuda else "reference"
    if dev.type == "cpu":
        return "cpp"
    return "reference"


class _Dispatch:
    """Routes each kernel call to ``_C`` or `reference` by the device of its first tensor argument.

    A CUDA tensor with a CPU-only build runs the reference on the GPU (correct, slower); this is the one
    fallback, and `backend` reports it.
    """

    def __getattr__(self, name: str) -> Callable[..., Any]:
        ref = getattr(reference, name)
        compiled = getattr(_C, name, None) if _C is not None else None
        if compiled is None:
            return ref
        with_cuda = bool(_C.with_cuda)

        def call(*args: Any) -> Any:
            first = next(a for a in args if isinstance(a, torch.Tensor))
            if first.device.type == "cpu" or (with_cuda and first.device.type == "cuda"):
                return compiled(*args)
            return ref(*args)

        call.__name__ = name
        setattr(self, name, call)  # cache: later lookups skip __getattr__
        return call


compiled_kernels = _Dispatch()


def kernels(kind: str) -> Any:
    """``"auto"``: compiled where available; ``"reference"``: the pure-torch oracle."""
    if kind == "auto":
        return compiled_kernels
    if kind == "reference":
        return reference
    raise ValueError(f"unknown kernels {kind!r}; use 'auto' or 'reference'")
