"""PEP 517 build backend: setuptools' own, building the codec extension against the torch already installed.

The extension must be compiled against the torch it will run with. Listing torch in ``[build-system]`` made pip
download a second, multi-GB CUDA torch into the isolated build environment and compile against that, and with
torch left out an isolated build has none. pip's default isolation runs this backend with the interpreter it
installs into and only removes that environment's site-packages from ``sys.path``; when the build
environment has no torch, they are appended again, after the isolated ones, so that the build requirements
still come from the isolated environment and only torch (and what it imports) from the installed one.
A build in a separate virtual environment (``python -m build``, uv) finds no torch here either, and setup.py
then stops with a message naming ``--no-isolation``.
"""

from __future__ import annotations

import importlib
import importlib.util
import site
import sys
import sysconfig
from pathlib import Path

from setuptools.build_meta import *  # noqa: F403 - every hook, optional ones included, exactly as setuptools has it
from setuptools.build_meta import __all__  # noqa: F401


def _installed_site_packages() -> list[str]:
    """This interpreter's own site-packages folders (the environment pip installs into), user site last."""
    folders = [sysconfig.get_path("platlib"), sysconfig.get_path("purelib")]
    try:
        folders.append(site.getusersitepackages())
    except AttributeError:  # an embedded interpreter's site module may lack it
        pass
    return [f for f in dict.fromkeys(folders) if f]


def expose_installed_torch() -> str | None:
    """Append the site-packages folder that holds the installed torch when the build environment has none;
    return it (None when nothing was needed or found)."""
    if importlib.util.find_spec("torch") is not None:
        return None
    for folder in _installed_site_packages():
        if folder not in sys.path and (Path(folder) / "torch" / "__init__.py").is_file():
            sys.path.append(folder)
            importlib.invalidate_caches()
            return folder
    return None


expose_installed_torch()
