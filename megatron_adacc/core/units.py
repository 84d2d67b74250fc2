"""Sizes as people write them (``12GiB``, ``800MB``, ``30G``) and as reports print them."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

#: Decimal units (``MB``, ``GB``) are powers of 1000; binary ones (``MiB``, ``GiB``) and the bare letters powers of
#: 1024: ``30G`` is what nvidia-smi, PyTorch and ``free -g`` users mean by it, and what our logs print (GiB).
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
           "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNITS = {"": 1, "b": 1, **_DECIMAL, **_BINARY}


class Size(int):
    """A number of bytes read from text, which remembers whether it was written in decimal units (``800MB``):
    :func:`format_bytes` prints it back in them, so that a budget given as ``30GB`` is not logged as 27.94 GiB."""

    decimal: bool = False

    def __new__(cls, value: int, decimal: bool = False) -> Size:
        size = super().__new__(cls, value)
        size.decimal = decimal
        return size

    def __reduce__(self):  # pickled into the profiler's child with the arguments
        return (Size, (int(self), self.decimal))


def parse_bytes(text: str | int) -> int:
    """``"12GiB"`` -> 12884901888; ``"500MB"`` -> 500000000; ``"30G"`` -> 30 GiB; plain integers are bytes.

    Returns a :class:`Size` for text. Raises ``argparse.ArgumentTypeError`` so it serves directly as a flag's
    ``type``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size: write a number of bytes or use a unit, e.g. 12GiB, 800MB, 512MiB"
        )
    return Size(int(float(match.group(1)) * _UNITS[unit]), decimal=unit in _DECIMAL)


def parse_positive_bytes(text: str | int) -> int:
    """:func:`parse_bytes` for sizes that must be at least one byte (budgets): ``0`` or ``0.5`` would otherwise
    read as "no budget given" further on."""
    n = parse_bytes(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is {n} bytes; a size here must be positive, e.g. 12GiB")
    return n


def checked(convert: Callable[[str], float], ok: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """A flag's ``type``: ``convert`` the text, then refuse a value that is NaN, infinite or not ``ok`` with
    "expected {expected}". At parse time the refusal names the flag, which the code that would otherwise take
    the value (a constructor, deep in model set-up) cannot."""
    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value
    return parse


positive_int = checked(int, lambda n: n >= 1, "a positive integer")


def format_bytes(n: float | int | None, digits: int = 1, *, like: float | int | None = None) -> str:
    """``digits`` decimals (whole bytes below 1 KiB); ``-`` for None. Binary units (KiB, MiB ...), or decimal ones
    (kB, MB ...) for a :class:`Size` written in them; ``like`` prints ``n`` in the units of that other size (a
    prediction beside the budget the user gave)."""
    if n is None:
        return "-"
    decimal = getattr(n if like is None else like, "decimal", False)
    step, units = (1000, ("B", "kB", "MB", "GB", "TB")) if decimal else (1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= step
    return str(n)
