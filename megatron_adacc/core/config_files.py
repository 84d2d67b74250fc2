"""Where the model configurations (``configs/*.toml``) are, for both hosts: ``adacc train --config NAME`` and
``python -m megatron_adacc.megatron_lm.configs NAME``.

A checkout keeps them in the repository's top-level ``configs/``, beside ``README.md``. Files outside the
package are not part of a wheel, so the build (``setup.py``) copies them into the package as
``megatron_adacc/configs/``, package data found through :mod:`importlib.resources`; that copy, when present,
is the one shipped with the running code and wins. An editable install has none and reads the checkout's.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def _shipped() -> Path | None:
    """Where the installed package's copy would be, when the package is a folder on disk (not a zip)."""
    folder = resources.files("megatron_adacc") / "configs"
    return folder if isinstance(folder, Path) else None


_PACKAGE_COPY = _shipped()
_CHECKOUT = Path(__file__).resolve().parents[2] / "configs"


def config_dir() -> Path:
    """The folder the named configs are in (the checkout's, when neither exists: errors then name it)."""
    return _PACKAGE_COPY if _PACKAGE_COPY is not None and _PACKAGE_COPY.is_dir() else _CHECKOUT


def find(name: str | Path) -> Path | None:
    """A TOML file's path, or a config's name (``tiny`` -> ``configs/tiny.toml``); None when neither exists."""
    folder = config_dir()
    for candidate in (Path(name), folder / str(name), folder / f"{name}.toml"):
        if candidate.is_file():
            return candidate
    return None


def known() -> list[str]:
    """The names of the configs there are, sorted (for error messages)."""
    return sorted(path.stem for path in config_dir().glob("*.toml"))
