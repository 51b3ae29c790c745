"""Plain-text tables for the terminal (column widths from the content, chosen columns right-aligned)."""
from __future__ import annotations

from collections.abc import Collection


def grid(head: list[str], body: list[list[str]], right: Collection[int] = ()) -> str:
    """Header, a dashed rule and the body rows, columns separated by two spaces."""
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        parts = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(parts).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])
