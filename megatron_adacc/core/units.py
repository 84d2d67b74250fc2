"""Sizes as people write them (``12GiB``, ``800MB``) and as reports print them."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"12GiB"`` -> 12884901888; ``"500MB"`` -> 500000000; plain integers are bytes.

    Raises ``argparse.ArgumentTypeError`` so it serves directly as a flag's ``type``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size: write a number of bytes or use a unit, e.g. 12GiB, 800MB, 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


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


def format_bytes(n: float | int | None, digits: int = 1) -> str:
    """Binary units, ``digits`` decimals (whole bytes below 1 KiB); ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return str(n)
