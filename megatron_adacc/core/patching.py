"""The one way megatron-adacc patches a function of Megatron or torch.

Every patch is idempotent (a marker on the installed wrapper), keeps the original reachable as
``__wrapped__`` (so :func:`unpatch` and debuggers find it), and fails with the installed version's name when the
target is missing instead of an ``AttributeError`` deep inside a training run.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from megatron_adacc.core.errors import PatchTargetMissing

MARKER = "__megatron_adacc_patched__"


def is_patched(obj: Any) -> bool:
    """Whether ``obj`` is a wrapper installed by :func:`patch` (or marked by :func:`mark`)."""
    return bool(getattr(obj, MARKER, False))


def mark(wrapper: Any, original: Any) -> Any:
    """Record ``original`` on ``wrapper`` as ``__wrapped__`` and set the patch marker; returns ``wrapper``.

    For wrappers that are installed by hand (on an instance, or under several names at once)."""
    target = getattr(wrapper, "__func__", wrapper)  # a bound method forwards attribute writes to its function
    target.__wrapped__ = original
    setattr(target, MARKER, True)
    return wrapper


def version_of(owner: Any) -> str:
    """``megatron-core X.Y.Z`` or ``torch X.Y.Z`` for the distribution ``owner`` belongs to."""
    module = owner if isinstance(owner, ModuleType) else inspect.getmodule(owner)
    root = (getattr(module, "__name__", "") or "").split(".")[0]
    package = {"megatron": "megatron.core"}.get(root, root)
    try:
        version = getattr(importlib.import_module(package), "__version__", "unknown")
    except ImportError:
        version = "unknown"
    return f"{package.replace('.', '-')} {version}" if package else "unknown version"


def _owner_name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__


def target(owner: Any, name: str, why: str = "") -> Any:
    """``owner.name``, or :class:`PatchTargetMissing` naming it, the installed version and ``why``.

    On a module or class the attribute as stored (a static or class method stays one); on an instance the
    bound method, which the instance attribute that replaces it must call."""
    if isinstance(owner, (ModuleType, type)):
        original = inspect.getattr_static(owner, name, None)
    else:
        original = getattr(owner, name, None)
    if original is None:
        hint = f" ({why})" if why else ""
        raise PatchTargetMissing(
            f"{_owner_name(owner)}.{name} does not exist in {version_of(owner)}{hint}; megatron-adacc supports "
            "the releases listed in README.md (Supported versions)")
    return original


def patch(owner: Any, name: str, make_wrapper: Callable[[Any], Any], why: str = "") -> Any:
    """Replace ``owner.name`` by ``make_wrapper(original)``, once; returns the installed wrapper.

    ``owner`` is a module, a class or an instance. A second call finds the marker and changes nothing. The
    wrapper gets ``functools.wraps(original)`` unless it set its own ``__wrapped__``; static and class methods
    stay what they were.
    """
    original = target(owner, name, why)
    if is_patched(original) or is_patched(getattr(original, "__func__", None)):
        return original
    kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    function = original.__func__ if kind else original
    wrapper = make_wrapper(function)
    if not hasattr(wrapper, "__wrapped__"):
        functools.update_wrapper(wrapper, function)
    mark(wrapper, function)
    setattr(owner, name, kind(wrapper) if kind else wrapper)
    return wrapper


def unpatch(owner: Any, name: str) -> bool:
    """Put back what :func:`patch` replaced; False when ``owner.name`` is not patched."""
    current = inspect.getattr_static(owner, name, None)
    kind = type(current) if isinstance(current, (staticmethod, classmethod)) else None
    function = current.__func__ if kind else current
    if not is_patched(function):
        return False
    original = function.__wrapped__
    if not isinstance(owner, (ModuleType, type)) and name in vars(owner):
        delattr(owner, name)  # an instance patch: the class attribute shows through again
        if getattr(type(owner), name, None) is not None:
            return True
    setattr(owner, name, kind(original) if kind else original)
    return True
