"""ConstraintLimits: how large and how deep an output constraint may be, checked in Python before any native call.

Why by hand: llguidance (Rust) compiles `$ref` chains and rule references by recursion on the calling thread's
stack, about 3.4 KB a level (measured: a chain of 2,300 `$ref`s overflows an 8 MiB stack). A stack overflow in
native code is a segfault — the whole server gone — and no Python `try` catches it. So every constraint is
measured here first, in time linear in its size, by walking it as the compiler will:

| limit              | what it bounds                                                     | default |
| ------------------ | ------------------------------------------------------------------ | ------- |
| max_bytes          | the constraint's text (schema JSON, grammar, regex, choices)       | 256 KiB |
| max_depth          | nesting + `$ref` / rule-reference chains (the compiler's recursion) | 256     |
| max_rules          | schema objects, or grammar rule definitions                        | 10,000  |
| max_alternatives   | branches of one anyOf / oneOf / allOf, alternatives of one rule    | 1,000   |
| max_choices        | `choice` entries, one `enum`'s values, one terminal's alternatives | 10,000  |

The depth is an upper bound that holds whatever order the compiler visits things in: the reference graph
(a schema's sub-schemas and `$ref` targets, a grammar's rule references) is cut into strongly connected
components, and the bound is the heaviest path through them, each component weighing its size (a recursive
descent that memoizes what it has started visits each node of a cycle at most once on one path). Recursive
schemas and grammars are fine: a cycle costs its size, once.

Beside these, compiles run on threads whose stack is `COMPILE_STACK_BYTES` (compile_workers.py): at the
largest `max_depth` EngineArgs accepts (`MAX_DEPTH_CEILING`), the measured recursion needs ~34 MiB of it.
max_alternatives stays below llguidance's Earley row limit (2,000 items), past which a grammar fails at its
first token rather than when it is compiled.
"""
from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from octavo.errors import InvalidRequestError
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

MAX_DEPTH_CEILING = 10_000  # the largest max_depth a configuration may set (the compile stack is sized for it)
MAX_ALTERNATIVES_CEILING = 1_900  # below llguidance's max_items_in_row (2,000)
# llguidance's GBNF -> Lark translator (Python) takes time in the square of the rule count: 1,000 rules 0.3 s,
# 4,000 rules 4.9 s (measured on a Zen 3 core); a GBNF grammar may have at most this many (or max_rules, if fewer)
GBNF_MAX_RULES = 1_000
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_\-.]+[ \t]*::=", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class ConstraintLimits:
    max_bytes: int = 256 << 10
    max_depth: int = 256
    max_rules: int = 10_000
    max_alternatives: int = 1_000
    max_choices: int = 10_000
    compile_timeout: float = 10.0  # seconds a request waits for its constraint to compile (then a 400)

    def validate(self) -> None:
        for name, lo, hi in (("max_bytes", 1, 1 << 30), ("max_depth", 1, MAX_DEPTH_CEILING),
                             ("max_rules", 1, 10_000_000), ("max_alternatives", 1, MAX_ALTERNATIVES_CEILING),
                             ("max_choices", 1, 10_000_000)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InvalidRequestError(f"constraint limit {name} must be an integer in [{lo}, {hi}], got {v!r}")
        t = self.compile_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise InvalidRequestError(f"constraint compile_timeout must be in (0, 3600] seconds, got {t!r}")


class _Over(Exception):
    """A limit was passed (turned into a StructuredOutputError naming the limit and its flag)."""

    def __init__(self, limit: str, what: str) -> None:
        super().__init__(what)
        self.limit, self.what = limit, what


def check_limits(p: StructuredOutputsParams, limits: ConstraintLimits) -> None:
    """StructuredOutputError if P's constraint is larger or deeper than LIMITS allow (pure Python, linear).
    A GBNF grammar's size is checked here, its rules once translated to Lark (check_translated_lark)."""
    with _as_error(p.kind, limits):
        _check(p, limits)


def check_translated_lark(text: str, limits: ConstraintLimits) -> None:
    """check_limits' rule checks for a GBNF grammar once translated to Lark (TEXT)."""
    with _as_error("grammar", limits):
        check_lark(text, limits)


@contextlib.contextmanager
def _as_error(kind: str, limits: ConstraintLimits) -> Iterator[None]:
    try:
        yield
    except _Over as over:
        flag = "--max-constraint-" + over.limit.removeprefix("max_").replace("_", "-")
        raise StructuredOutputError(f"the {_NAMES[kind]} is too large for this server: {over.what} (limit "
                                    f"{over.limit} = {getattr(limits, over.limit)}; the server's {flag})",
                                    "json" if kind == "json_object" else kind) from None
    except RecursionError:
        raise StructuredOutputError(f"the {_NAMES[kind]} is nested too deeply", kind) from None


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def check_translated_lark(text: str, limits: ConstraintLimits) -> None:
    """check_limits for a GBNF grammar once translated to Lark (TEXT)."""
    check_limits(StructuredOutputsParams(grammar=text), limits)


def _check(p: StructuredOutputsParams, limits: ConstraintLimits) -> None:
    kind = p.kind
    if kind == "json":
        _bytes(len(json.dumps(p.json, ensure_ascii=False)), limits)
        check_schema(p.json, limits)
    elif kind == "regex":
        _bytes(len(p.regex), limits)
    elif kind == "choice":
        if len(p.choice) > limits.max_choices:
            raise _Over("max_choices", f"{len(p.choice)} choices")
        _bytes(sum(len(c) + 4 for c in p.choice), limits)
    elif kind == "grammar":
        _bytes(len(p.grammar), limits)
        if not is_gbnf(p.grammar):
            check_lark(p.grammar, limits)
        else:  # its rules are checked once translated to Lark (check_translated_lark); first, the translation's cost
            cap = min(limits.max_rules, GBNF_MAX_RULES)
            rules = sum(1 for _ in _GBNF_RULE.finditer(p.grammar))
            if rules > cap:
                raise _Over("max_rules", f"{rules} GBNF rules (a GBNF grammar may have at most {cap})")
    if p.whitespace_pattern is not None:
        _bytes(len(p.whitespace_pattern), limits)


def is_gbnf(text: str) -> bool:
    """GBNF / EBNF (llama.cpp's `root ::= ...`) rather than Lark."""
    return "::=" in text


def _bytes(n: int, limits: ConstraintLimits) -> None:
    if n > limits.max_bytes:
        raise _Over("max_bytes", f"{n} characters")


# -- JSON schema --------------------------------------------------------------------------------------
_SCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
           "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_schema(schema: Any, limits: ConstraintLimits) -> None:
    """Raise _Over if SCHEMA (a JSON schema as parsed JSON) passes LIMITS."""
    nodes: dict[int, list[int]] = {}  # id(schema object) -> ids of the schemas it leads to (sub-schemas, $ref)
    todo = [schema]
    while todo:
        s = todo.pop()
        if not isinstance(s, dict) or id(s) in nodes:
            continue
        if len(nodes) >= limits.max_rules:
            raise _Over("max_rules", f"more than {limits.max_rules} schema objects")
        edges = nodes[id(s)] = []
        for sub in _subschemas(s, limits):
            edges.append(id(sub))
            todo.append(sub)
        ref = s.get("$ref")
        if isinstance(ref, str):
            target = _resolve(schema, ref)
            if isinstance(target, dict):
                edges.append(id(target))
                todo.append(target)
    depth = heaviest_path(nodes)
    if depth > limits.max_depth:
        raise _Over("max_depth", f"nesting and $ref chains {depth} deep")


def _subschemas(s: dict[str, Any], limits: ConstraintLimits) -> Iterator[dict[str, Any]]:
    for key in _SCHEMA_LISTS:
        v = s.get(key)
        if isinstance(v, list):
            if key in ("anyOf", "oneOf", "allOf") and len(v) > limits.max_alternatives:
                raise _Over("max_alternatives", f"{key} of {len(v)} schemas")
            yield from (x for x in v if isinstance(x, dict))
    for key in _SCHEMA:
        v = s.get(key)
        if isinstance(v, dict):
            yield v
    for key in _SCHEMA_MAPS:
        v = s.get(key)
        if isinstance(v, dict):
            yield from (x for x in v.values() if isinstance(x, dict))
    enum = s.get("enum")
    if isinstance(enum, list) and len(enum) > limits.max_choices:
        raise _Over("max_choices", f"an enum of {len(enum)} values")


def _resolve(root: Any, ref: str) -> Any:
    """The object a local `$ref` ("#", "#/a/b/0") points at in ROOT; None for anything else."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def heaviest_path(graph: dict[Any, list[Any]]) -> int:
    """The most nodes on a path through GRAPH (node -> successors; successors outside GRAPH are ignored), each
    strongly connected component counting all its nodes: an upper bound on the depth of any depth-first walk
    that does not re-enter a node it is inside. Iterative (Tarjan), O(nodes + edges)."""
    index: dict[Any, int] = {}
    low: dict[Any, int] = {}
    comp: dict[Any, int] = {}
    sizes: list[int] = []
    best: list[int] = []  # per component: the heaviest path starting in it
    stack: list[Any] = []
    on_stack: set[Any] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            succ = graph[v]
            while i < len(succ):
                w = succ[i]
                i += 1
                if w not in graph:
                    continue
                if w not in index:
                    work.append((v, i))
                    work.append((w, 0))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:  # v roots a component; its successors' components are all numbered
                    members = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp[w] = len(sizes)
                        members.append(w)
                        if w == v:
                            break
                    c = len(sizes)
                    sizes.append(len(members))
                    below = max((best[comp[w]] for m in members for w in graph[m]
                                 if w in comp and comp[w] != c), default=0)
                    best.append(len(members) + below)
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
    return max(best, default=0)


# -- Lark ---------------------------------------------------------------------------------------------
_LARK_TOKEN = re.compile(r"""
    (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<newline>\n)
  | (?P<space>[ \t\r\f\v]+)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_\-]*)
  | (?P<bar>\|)
  | (?P<open>[(\[{])
  | (?P<close>[)\]}])
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def check_lark(text: str, limits: ConstraintLimits) -> None:
    """Raise _Over if the Lark grammar TEXT passes LIMITS. A scan, not a parse: what it cannot read it leaves to
    llguidance's own checks; what it counts is an upper bound of what the compiler will meet."""
    rules: dict[str, list[str]] = {}  # rule / terminal name -> the names its body mentions
    alternatives: dict[str, int] = {}
    current: str | None = None
    line_start = True
    nesting = 0
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(text):
        m = _LARK_TOKEN.match(text, pos)
        assert m is not None  # (the last alternative matches any character)
        kind, tok, pos = m.lastgroup, m.group(), m.end()
        if kind == "newline":
            line_start = True
            continue
        if kind == "comment":
            continue
        if kind == "space":  # an indented line continues the rule above it
            line_start = False
            continue
        at_start, line_start = line_start, False
        if kind == "directive":
            current = None  # %import / %ignore / ... end the rule before them
            brace = re.compile(r"\s*\{").match(text, pos)
            if brace is not None:  # %json {...} (an inline schema) and friends: read the object as JSON
                try:
                    obj, pos = decoder.raw_decode(text, brace.end() - 1)
                except ValueError:
                    return  # malformed: llguidance's error will say where
                if tok == "%json":
                    check_schema(obj, limits)
            continue
        if kind == "name" and at_start:
            name = tok.lstrip("?!")
            if name not in rules:
                if len(rules) >= limits.max_rules:
                    raise _Over("max_rules", f"more than {limits.max_rules} rules")
                rules[name] = []
                alternatives[name] = 1
            current = name
            continue
        if current is None:
            continue
        if kind == "name":
            rules[current].append(tok.lstrip("?!"))
        elif kind == "bar":
            alternatives[current] += 1
            cap, limit = ((limits.max_choices, "max_choices") if _is_terminal(current)
                          else (limits.max_alternatives, "max_alternatives"))
            if alternatives[current] > cap:
                raise _Over(limit, f"rule {current!r} has more than {cap} alternatives")
        elif kind == "open":
            nesting += 1
            if nesting > limits.max_depth:
                raise _Over("max_depth", f"brackets nested more than {limits.max_depth} deep")
        elif kind == "close":
            nesting = max(0, nesting - 1)
    depth = heaviest_path(rules)
    if depth > limits.max_depth:
        raise _Over("max_depth", f"rule references chained {depth} deep")


def _is_terminal(name: str) -> bool:
    """Lark's convention: terminals are upper-case names (they compile to the lexer, not the Earley parser)."""
    return name.upper() == name
