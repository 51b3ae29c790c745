"""The `qwen3_coder` tool-call parser (vLLM's name): Qwen3-Coder's XML-style calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

any number, after optional content. A parameter's value is text (one newline after the opening tag and one
before the closing tag belong to the layout); it becomes the JSON type that the tool's parameter schema
declares, as vLLM reads it: "string" (or no type) stays text, integer and number types are read as numbers
(a whole number as an integer), "boolean" as true/false, anything else (object, array) as JSON or a Python
literal; a value that does not read as its type stays text; "null" is null for every type. A parameter the
schema does not know stays text. Calls must be inside <tool_call> blocks (vLLM also reads a bare <function=...>). Streamed like hermes: content at once, each call when its block is complete.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from octavo.serving.tool_parsers import BlockStreamer, Parsed, whole
from octavo.serving.tools import ToolCall

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)


class Qwen3CoderParser:
    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}

    def parse(self, text: str) -> Parsed:
        return whole(self.streamer(), text)

    def streamer(self) -> BlockStreamer:
        return BlockStreamer(self.START, self.END, self.block_call)

    def block_call(self, block: str) -> ToolCall | None:
        """The call in one '<tool_call>...</tool_call>' block (the end tag may be missing), or None."""
        body = block.strip().removeprefix(self.START).removesuffix(self.END)
        m = _FUNCTION.search(body)
        if m is None or body[:m.start()].strip():
            return None
        name = m.group(1).strip()
        props = self._schemas.get(name, {}).get("properties") or {}
        args: dict[str, Any] = {}
        for p in _PARAMETER.finditer(m.group(2)):
            key = p.group(1).strip()
            args[key] = _value(_unwrapped(p.group(2)), props.get(key))
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _unwrapped(text: str) -> str:
    text = text.removeprefix("\n")
    return text.removesuffix("\n")


def _value(text: str, schema: Any) -> Any:
    """TEXT as the type SCHEMA declares (vLLM's reading: int*/long/short/unsigned -> int, num*/float* -> a number
    (int when whole), string/str/text/char/enum or no type -> text, anything else JSON then a Python literal);
    a value that does not read as its type stays text (a boolean too: not silently false)."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), None)
    kind = str(kind).strip().lower() if kind is not None else "string"
    t = text.strip()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(t)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            f = float(t)
        except ValueError:
            return text
        return int(f) if f.is_integer() and abs(f) < 2 ** 63 else f
    if kind in ("boolean", "bool", "binary"):
        return t.lower() == "true" if t.lower() in ("true", "false") else text
    try:
        return json.loads(t)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(t)
        json.dumps(value)  # a set, bytes, a complex number: not JSON, so not an argument value
        return value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


__all__ = ["Qwen3CoderParser"]
