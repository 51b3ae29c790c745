"""Short display names for request ids: a server's ids (`cmpl-3f2a9c4b5e6d7f8a9b0c1d2e3f4a5b6c-0`) would take a
third of a picture's width; the demo's (`6`) are already short and stay as they are.

The prefix every id shares (`cmpl-`) is dropped, then a long id keeps its head, its last three characters and its
choice suffix (`-0`) around an ellipsis; heads grow until every name is distinct, so no two requests ever share
a label.
"""
from __future__ import annotations

import os

WIDTH = 12


def short_ids(ids: list[str], width: int = WIDTH) -> dict[str, str]:
    """{id: display name} with names at most about WIDTH characters, all distinct."""
    unique = list(dict.fromkeys(ids))
    if all(len(i) <= width for i in unique):
        return {i: i for i in unique}
    prefix = os.path.commonprefix(unique) if len(unique) > 1 else ""
    cut = max(prefix.rfind("-"), prefix.rfind("_")) + 1  # drop whole words only ("cmpl-", not "cmpl-3f")
    rest = {i: i[cut:] or i for i in unique}
    for head in range(max(1, width - 7), max(len(r) for r in rest.values()) + 1):
        names = {i: _shorten(r, head) for i, r in rest.items()}
        if len(set(names.values())) == len(names):
            return names
    return rest


def _shorten(text: str, head: int) -> str:
    base, sep, tail = text.rpartition("-")
    keep = sep + tail if sep and base and len(tail) <= 3 else ""
    body = text[: len(text) - len(keep)]
    return text if len(body) <= head + 4 else body[:head] + "…" + body[-3:] + keep
