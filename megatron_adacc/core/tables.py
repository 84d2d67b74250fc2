"""Text tables for a terminal: every bench's results, ``adacc show``'s per-op table, at most :data:`WIDTH`
characters a line.

A table wider than that does not wrap in the terminal (which would tear every row apart): its widest columns
wrap their own cells, at spaces first, then after ``_``, ``@`` and ``/`` (``int4_channelwise@16MB``), and only as a
last resort anywhere, until the table fits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

#: The widest line a table may have: a terminal of 100 columns, or a log viewer, shows it unwrapped.
WIDTH = 100
#: Between two columns.
GAP = "  "

# A run of spaces, or a piece of text up to and including a character after which a line may break.
_PIECES = re.compile(r"\s+|[^\s_@/]*[_@/]|[^\s_@/]+")


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters: broken at spaces, else after ``_ @ /``, else anywhere."""
    width = max(1, width)
    out: list[str] = []
    for paragraph in str(text).split("\n"):
        line = ""
        for piece in _PIECES.findall(paragraph):
            if piece.isspace():
                line += " " if line else ""
                continue
            if len(line) + len(piece) > width and line.strip():
                out.append(line.rstrip())
                line = ""
            while len(piece) > width:  # no place to break: cut
                out.append(piece[:width])
                piece = piece[width:]
            line += piece
        out.append(line.rstrip())
    return out


def _natural(column: Sequence[str]) -> int:
    return max(len(line) for cell in column for line in cell.split("\n"))


def _floor(column: Sequence[str], pieces: re.Pattern | None) -> int:
    """The narrowest the column gets breaking its cells only at spaces (``pieces`` None), or at every place
    :func:`wrap` may break, without cutting a piece of text."""
    found = [len(p) for cell in column for p in (pieces.findall(cell) if pieces else cell.split()) if not p.isspace()]
    return max(found, default=1)


def fit_widths(columns: Sequence[Sequence[str]], width: int = WIDTH, gap: int = len(GAP)) -> list[int]:
    """Column widths whose sum with the gaps is at most ``width`` where possible: the widest column narrows first,
    to what its cells then need (a cell that breaks in two needs only its longer line). Cells break at spaces
    first, so that names (``megatron_selective``) stay whole while numbers with their ratios wrap; then after
    ``_ @ /``; then anywhere."""
    widths = [_natural(c) for c in columns]
    budget = width - gap * (len(columns) - 1)
    for floors in ([_floor(c, None) for c in columns], [_floor(c, _PIECES) for c in columns], [1] * len(columns)):
        while sum(widths) > budget:
            shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
            if not shrinkable:
                break
            i = max(shrinkable, key=lambda k: widths[k])
            target = max(floors[i], widths[i] - 1)
            widths[i] = max(len(line) for cell in columns[i] for line in wrap(cell, target))
    return widths


def format_table(header: Sequence[object], rows: Iterable[Sequence[object]], *, right: Iterable[int] = (),
                 width: int = WIDTH) -> str:
    """``rows`` under ``header``, a rule between them, columns ``right`` (indices) right-aligned and the rest left,
    each line at most ``width`` characters (:func:`fit_widths`); a cell that does not fit takes several lines."""
    table = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = fit_widths([[row[i] for row in table] for i in range(len(table[0]))], width)
    right = set(right)
    lines = []
    for index, row in enumerate(table):
        cells = [wrap(cell, w) for cell, w in zip(row, widths)]
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "") for c in cells]
            lines.append(GAP.join(p.rjust(w) if i in right else p.ljust(w)
                                  for i, (p, w) in enumerate(zip(parts, widths))).rstrip())
        if index == 0:
            lines.append(GAP.join("-" * w for w in widths))
    return "\n".join(lines)
