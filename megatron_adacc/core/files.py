"""Writing files so that a crash or a planted link never leaves a half-written or misdirected one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from megatron_adacc.core.errors import OutputNotWritable


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(f)`` on a new temporary file beside ``path``, then rename it onto ``path``.

    The temporary name is random and created exclusively (``O_EXCL``), so a symlink planted at a predictable
    name cannot redirect the write; until the rename, readers see the previous file, never half of the new one.
    Parent folders are created. An OS error (a folder in the way, no space) is an
    :class:`~megatron_adacc.core.errors.OutputNotWritable` that names the path: every caller writes a path the
    user chose.
    """
    path = Path(path)
    try:
        return _atomic_write(path, write)
    except OSError as exc:
        if isinstance(exc, OutputNotWritable):
            raise
        raise OutputNotWritable(f"cannot write {path}: {_why_not(path, exc)}") from exc


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _why_not(path: Path, exc: OSError) -> str:
    if path.is_dir():
        return "it is a folder; name a file"
    in_the_way = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if in_the_way is not None:
        return f"{in_the_way} is a file, not a folder"
    return exc.strerror or str(exc)
