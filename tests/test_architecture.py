"""The house rules of docs/architecture.md, checked on the source: the import graph of the `octavo` package (every
import statement an arrow: module level, inside functions, under TYPE_CHECKING) has no cycle, no arrow from a
lower room to a higher one, and no module is longer than 600 lines. A new package or top-level module must be
given a room in ROOMS below (and in docs/architecture.md), or this fails.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "octavo"
MAX_LINES = 600

# rooms, lowest first: a module may import its own room and the rooms below it, never one above
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("octavo.errors", "octavo.version", "octavo.extras", "octavo.resources", "octavo.reference")),
    ("model", ("octavo.export", "octavo.structured")),
    ("engine", ("octavo.runtime", "octavo.tensorrt")),
    ("users of the engine", ("octavo.serving", "octavo.tracing", "octavo.bench", "octavo.demo", "octavo.oplib_build")),
    ("servers on servers", ("octavo.triton_server", "octavo.ray_serve")),
    ("interface", ("octavo.commands", "octavo.cli", "octavo.__main__", "octavo")),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the octavo modules it imports (a name imported from a package counts as its submodule when
    there is one)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t.startswith("octavo") and t != name:
                    graph[name].add(t)
    return graph


def room(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(ROOMS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{module} has no room: add it to ROOMS here and to docs/architecture.md"
    return best[0]


def cycles(graph: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


MODS = modules()
GRAPH = imports(MODS)


def test_the_graph_is_read() -> None:  # the checks below would pass on an empty graph
    assert len(MODS) > 100 and "octavo.runtime.engine" in GRAPH["octavo.runtime.async_engine"]
    assert "octavo.structured.limits" in GRAPH["octavo.structured.grammar"]


def test_no_import_cycles() -> None:
    assert cycles(GRAPH, sorted(MODS)) == []


def test_no_import_from_a_lower_room_to_a_higher_one() -> None:
    upward = [f"{a} ({ROOMS[room(a)][0]}) -> {b} ({ROOMS[room(b)][0]})"
              for a in sorted(GRAPH) for b in sorted(GRAPH[a]) if room(b) > room(a)]
    assert upward == []


def test_no_module_is_longer_than_600_lines() -> None:
    long = {name: n for name, path in MODS.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checker_finds_what_it_looks_for() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, ["a", "b", "c", "d"]) == [["a", "b", "c"]]
    assert room("octavo.runtime.engine") > room("octavo.export.graph") > room("octavo.errors")
    with pytest.raises(AssertionError):
        room("octavo_elsewhere")
