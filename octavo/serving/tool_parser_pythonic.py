"""The `pythonic` tool-call parser (vLLM's name): calls written as a Python list of calls with keyword
arguments, the format of Llama 3.2 / Llama 4 and others prompted for it:

    [get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]

optionally inside Llama 4's <|python_start|> ... <|python_end|>. The output is calls only when it opens with
'[' (after whitespace): each element is read as it completes (streamed at once), its argument values as Python
literals (strings, numbers, True/False/None, lists, dicts; JSON's true/false/null too). From the first element
that is not such a call on, the text is content; an output that does not open with '[' is all content.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

from octavo.serving.tool_parsers import Parsed, StreamDelta, whole
from octavo.serving.tools import ToolCall

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser:
    name = "pythonic"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        pass

    def parse(self, text: str) -> Parsed:
        return whole(self.streamer(), text)

    def streamer(self) -> PythonicStreamer:
        return PythonicStreamer()


@dataclass(slots=True)
class PythonicStreamer:
    buf: str = ""  # text not yet passed on (while reading the list: from the start of the current element)
    mode: str = "head"  # "head" undecided, "list" reading elements, "after" the list closed, "content"
    opening: str = ""  # the text up to and including '[' (content again if the first element is no call)
    scanned: int = 0  # buf[:scanned] has been scanned (the state below is after it)
    depth: int = 0  # brackets open inside the current element
    quote: str = ""  # the open string's quote character, if in one
    escaped: bool = False
    calls_seen: int = 0

    def feed(self, text: str) -> StreamDelta:
        if self.mode == "content":
            return StreamDelta(content=text)
        self.buf += text
        out = StreamDelta()
        if self.mode == "head":
            head = self.buf.lstrip()
            if head.startswith(PYTHON_START):
                head = head[len(PYTHON_START):].lstrip()
            if not head or (PYTHON_START.startswith(head) and head != PYTHON_START):
                return out
            if not head.startswith("["):
                self.mode, out.content, self.buf = "content", self.buf, ""
                return out
            cut = len(self.buf) - len(head) + 1
            self.mode, self.opening, self.buf = "list", self.buf[:cut], self.buf[cut:]
        if self.mode == "list":
            self._elements(out)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        rest, self.buf = self.buf, ""
        if self.mode == "list":  # an unclosed list: its last element as it is
            body = rest.strip().removesuffix(PYTHON_END).strip()
            if body:
                self._element(body, "", out)
            elif self.calls_seen == 0:
                out.content = self.opening + rest
        elif self.mode == "after":
            out.content = rest.strip().removeprefix(PYTHON_END).strip()
        else:
            out.content = rest
        return out

    def _elements(self, out: StreamDelta) -> None:
        """Read every element that has ended (a ',' or ']' outside strings and brackets)."""
        i = self.scanned
        while i < len(self.buf):
            ch = self.buf[i]
            i += 1
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}" and self.depth > 0:
                self.depth -= 1
            elif ch in ",]" and self.depth == 0:
                element, self.buf, i = self.buf[:i - 1], self.buf[i:], 0
                if not self._element(element, ch, out):
                    return
                if ch == "]":  # the list is closed: what follows (the python_end tag, whitespace) is dropped
                    self.mode = "after"
                    return
        self.scanned = i

    def _element(self, element: str, sep: str, out: StreamDelta) -> bool:
        """One element, ended by SEP: a call (True), or the end of the calls: it and all after it are content
        (the whole output if it is the first)."""
        call = _call(element)
        if call is None:
            head = self.opening if self.calls_seen == 0 else ""
            out.content += head + element + sep + self.buf
            self.mode, self.buf = "content", ""
            return False
        out.calls.append(call)
        self.calls_seen += 1
        return True


def _call(source: str) -> ToolCall | None:
    """f(a=1, b="x") -> ToolCall, or None if SOURCE is not a call of a plain name with literal keywords."""
    source = source.strip()
    if not source or len(source) > 1_000_000:
        return None
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args:
        return None
    name = ast.unparse(node.func)
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = _literal(kw.value)
            json.dumps(args[kw.arg])
        except (ValueError, TypeError, RecursionError):
            return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


__all__ = ["PythonicParser"]
