"""ConstraintLimits (octavo/structured/limits.py) and the compile workers' stacks (compile_workers.py):

- the depth bound is checked against a brute-force reference (every simple path of small random graphs);
- schemas and grammars at the limits pass, one past them fail with a message naming the limit, and recursive
  ones (a cycle) are measured once, not refused;
- the issue's crash input at 10x (a 30,000-`$ref` chain) compiled natively, past the limits: on a plain 8 MiB
  thread it kills its process (so the test can fail), on a compile worker's stack it completes.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.structured.grammar import build_grammar
from octavo.structured.limits import ConstraintLimits, check_limits, heaviest_path
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

LIMITS = ConstraintLimits()


def reference_heaviest(graph: dict[int, list[int]]) -> int:
    """Brute force: components from mutual reachability, then the heaviest path over every simple path."""
    nodes = list(graph)
    reach = {v: {v} for v in nodes}
    changed = True
    while changed:
        changed = False
        for v in nodes:
            new = set().union(*(reach[w] for w in graph[v] if w in reach)) | reach[v]
            if new != reach[v]:
                reach[v], changed = new, True
    comp = {v: frozenset(w for w in nodes if w in reach[v] and v in reach[w]) for v in nodes}
    best = 0

    def walk(c: frozenset, seen: frozenset, weight: int) -> None:  # a path enters a component, leaves from any node
        nonlocal best
        best = max(best, weight)
        for u in c:
            for w in graph[u]:
                if comp[w] != c and comp[w] not in seen:
                    walk(comp[w], seen | {comp[w]}, weight + len(comp[w]))

    for c in set(comp.values()):
        walk(c, frozenset({c}), len(c))
    return best


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8).flatmap(lambda n: st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
                                                    max_size=14).map(lambda es: (n, es))))
def test_heaviest_path_matches_brute_force(case: tuple[int, list[tuple[int, int]]]) -> None:
    n, edges = case
    graph: dict[int, list[int]] = {v: [] for v in range(n)}
    for a, b in edges:
        graph[a].append(b)
    assert heaviest_path(graph) == reference_heaviest(graph)


def chain(n: int) -> dict:
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def limit_of(p: StructuredOutputsParams, limits: ConstraintLimits = LIMITS) -> str | None:
    try:
        check_limits(p, limits)
    except StructuredOutputError as exc:
        return str(exc)
    return None


def test_ref_chains_count_every_link() -> None:
    # root + N links + the last definition: N + 2 schema objects on one path
    assert limit_of(StructuredOutputsParams(json=chain(LIMITS.max_depth - 2))) is None
    msg = limit_of(StructuredOutputsParams(json=chain(LIMITS.max_depth - 1)))
    assert msg and "257 deep" in msg and "max_depth = 256" in msg and "--max-constraint-depth" in msg


def test_recursive_schemas_pass_and_count_their_cycle_once() -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    assert limit_of(StructuredOutputsParams(json=tree)) is None
    build_grammar(StructuredOutputsParams(json=tree))  # and llguidance compiles it
    ring = {"$defs": {f"r{i}": {"anyOf": [{"type": "null"}, {"$ref": f"#/$defs/r{(i + 1) % 300}"}]}
                      for i in range(300)}, "$ref": "#/$defs/r0"}  # a cycle of 300 definitions: 300 deep
    assert "deep" in (limit_of(StructuredOutputsParams(json=ring)) or "")


@pytest.mark.parametrize("p, words", [
    (StructuredOutputsParams(json={"anyOf": [{"const": i} for i in range(1001)]}), "anyOf of 1001"),
    (StructuredOutputsParams(json={"enum": list(range(10_001))}), "enum of 10001"),
    (StructuredOutputsParams(choice=[str(i) for i in range(10_001)]), "10001 choices"),
    (StructuredOutputsParams(regex="a" * (256 << 10) + "b"), "262145 characters"),
    (StructuredOutputsParams(grammar="start: " + " | ".join(f'"{i}"' for i in range(1001))), "1000 alternatives"),
    (StructuredOutputsParams(grammar="start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(300)) + 'a300: "x"'),
     "302 deep"),
    (StructuredOutputsParams(grammar="start: %json " + json.dumps(chain(300))), "302 deep"),
    (StructuredOutputsParams(grammar="root ::= " + "\n".join(f'r{i} ::= "x"' for i in range(1001))), "GBNF rules"),
    (StructuredOutputsParams(grammar="start: " + "(" * 300 + '"x"' + ")" * 300), "nested more than 256"),
])
def test_one_past_a_limit_is_refused_naming_it(p: StructuredOutputsParams, words: str) -> None:
    msg = limit_of(p)
    assert msg and words in msg and "too large for this server" in msg, msg


@pytest.mark.parametrize("p", [
    StructuredOutputsParams(json={"anyOf": [{"const": i} for i in range(1000)]}),
    StructuredOutputsParams(choice=[f"choice {i}" for i in range(10_000)]),
    StructuredOutputsParams(grammar="start: CHOICE\nCHOICE: " + " | ".join(f'"{i}"' for i in range(5000))),  # lexer
    StructuredOutputsParams(grammar='start: expr\nexpr: term (("+" | "-") term)*\nterm: /[0-9]+/ | "(" expr ")"\n'),
    StructuredOutputsParams(grammar='root ::= "a" | "b" ("c" | root)\n'),
])
def test_ordinary_and_at_limit_constraints_pass_and_compile(p: StructuredOutputsParams) -> None:
    assert limit_of(p) is None
    build_grammar(p)


def test_limits_are_configurable_and_validated() -> None:
    small = ConstraintLimits(max_depth=20)
    assert "22 deep" in (limit_of(StructuredOutputsParams(json=chain(20)), small) or "")
    for bad in ({"max_depth": 0}, {"max_depth": 10_001}, {"max_alternatives": 2000}, {"compile_timeout": 0},
                {"max_bytes": True}):
        with pytest.raises(ValueError):
            ConstraintLimits(**bad).validate()


CRASH = textwrap.dedent("""
    import sys, threading, llguidance as llg
    from octavo.structured.compile_workers import CompileWorkers
    n = 30000
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i+1}"} for i in range(n)}; defs[f"a{n}"] = {"type": "string"}
    schema = {"$defs": defs, "$ref": "#/$defs/a0"}
    def compile_():
        g = llg.LLMatcher.grammar_from_json_schema(schema)
        return llg.LLMatcher.validate_grammar_with_warnings(g)[0]
    if sys.argv[1] == "workers":
        print("compiled, error:", CompileWorkers(threads=1).submit(compile_).result())
    else:
        threading.stack_size(8 << 20)
        t = threading.Thread(target=lambda: print("compiled, error:", compile_())); t.start(); t.join()
""")


def test_a_compile_worker_survives_what_kills_a_plain_thread() -> None:
    """The issue's crash input at 10x, past every Python limit, straight into llguidance."""
    plain = subprocess.run([sys.executable, "-c", CRASH, "plain"], capture_output=True, text=True, timeout=300)
    assert plain.returncode != 0 and "compiled" not in plain.stdout  # a stack overflow: the process is gone
    workers = subprocess.run([sys.executable, "-c", CRASH, "workers"], capture_output=True, text=True, timeout=300)
    assert workers.returncode == 0 and "compiled, error: False" in workers.stdout, workers.stderr[-2000:]


def test_compile_queue_is_bounded() -> None:
    import threading

    from octavo.structured.compile_workers import CompileQueueFullError, CompileWorkers

    gate = threading.Event()
    w = CompileWorkers(threads=1, max_queued=2)
    started = threading.Event()
    running = w.submit(lambda: (started.set(), gate.wait()))
    assert started.wait(30)  # the worker holds the first job: the queue now holds what follows
    queued = [w.submit(lambda: 1) for _ in range(2)]
    with pytest.raises(CompileQueueFullError):
        w.submit(lambda: 1)
    gate.set()
    assert [f.result(timeout=30) for f in queued] == [1, 1] and running.result(timeout=30)[0] is None
    w.close()


def test_heaviest_path_on_a_long_chain_is_iterative() -> None:
    graph = {i: [i + 1] for i in range(200_000)}
    graph[200_000] = []
    assert heaviest_path(graph) == 200_001
