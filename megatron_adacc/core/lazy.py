"""Package faces that import their modules on first use.

Every run imports each feature's registry entry (to add its flags), and an entry lives in its feature's
package; so a feature package's ``__init__`` must not import torch or the feature's modules when it is
imported, or a run with every feature off would load them all. A package lists what it exports and where
from, and :func:`exports` gives it a module ``__getattr__`` (PEP 562) that imports on first access.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """``__getattr__`` for ``package`` that resolves ``name`` as ``names[name]`` (a module path) ``.name``."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)  # resolved once
        return value

    return __getattr__
