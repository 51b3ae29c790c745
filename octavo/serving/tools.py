"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` -> what to render,
what to constrain and how to read the output back.

  tool_choice "none"      tools reach the chat template, the output is plain content;
              "auto"      (default when tools are given) the server's --tool-call-parser reads calls out of
                          the text (octavo/serving/tool_parsers.py); without a parser it is a 400, as in vLLM;
              "required"  the output is constrained to a JSON array of {"name", "parameters"} objects, one
                          per call (at most one when parallel_tool_calls is false), each matching its
                          function's parameter schema;
              {"type": "function", "function": {"name": N}}  the output is constrained to N's arguments.
So a forced call always parses and validates. Tools go to the template as HF's apply_chat_template(tools=...)
takes them: the OpenAI list of {"type": "function", "function": {...}}.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from octavo.serving.api_error import bad_request
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


@dataclass(slots=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the function, for mode "function"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tools(d: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = d.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools per request, got {len(tools)}", "tools")
    names: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                              "tools")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                              "tools")
        if name in names:
            raise bad_request(f"'{where}.function.name' {name!r} is defined twice", "tools")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", "tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON schema object", "tools")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise bad_request(f"'{where}.function.strict' must be a boolean", "tools")
        fn = {"name": name, **({"description": f["description"]} if f.get("description") is not None else {}),
              "parameters": params if params is not None else dict(ANY_ARGUMENTS)}
        out.append({"type": "function", "function": fn})
    return out


def parse_tool_choice(d: dict[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    tc = d.get("tool_choice")
    if tc is None:
        return ToolChoice("auto" if tools else "none")
    if tools is None and tc != "none":
        raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
    if tc in ("none", "auto", "required"):
        return ToolChoice(tc)
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict):
        name = tc["function"].get("name")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
        return ToolChoice("function", name)
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")


def function(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t["function"] for t in tools if t["function"]["name"] == name)


def constraint(tools: list[dict[str, Any]] | None, choice: ToolChoice,
               parallel: bool) -> tuple[StructuredOutputsParams, str] | tuple[None, None]:
    """The output constraint that enforces CHOICE and where its schema comes from, for errors ((None, None) for
    none / auto). Compiled by the engine's grammar workers, which the route awaits."""
    if tools is None or choice.mode in ("none", "auto"):
        return None, None
    if choice.mode == "function":
        schema = function(tools, choice.name or "")["parameters"]
        where = f"tools[{[t['function']['name'] for t in tools].index(choice.name)}].function.parameters"
    else:
        schema = required_schema(tools, parallel)
        where = "tools"
    try:
        # compact JSON: a call is read by a program, and free whitespace only costs tokens (and length cuts)
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    except StructuredOutputError as exc:
        raise bad_request(f"'{where}': {exc}", "tools") from None
    return params, where


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON array of calls, each {"name": <one of the tools>, "parameters": <its schema>}. Each tool's schema
    becomes a definition of the array's schema (`$defs/tool<i>`), its local `$ref`s ("#/$defs/X", pydantic's
    nested models) rewritten to point inside it, so they resolve where the schema now stands."""
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "parameters": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "$defs": {f"tool{i}": _rebased(t["function"]["parameters"], f"#/$defs/tool{i}")
                                        for i, t in enumerate(tools)}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_VALUES = frozenset({"enum", "const", "default", "examples"})  # keywords whose values are data, not schemas


def _rebased(schema: Any, root: str) -> Any:
    """A copy of SCHEMA whose local `$ref`s ("#...") are relative to ROOT instead of the document's root."""
    out = _copy_node(schema, root)
    todo = [out]
    while todo:  # iterative: a schema's depth is limited later (octavo/structured/limits.py), not here
        node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(node, dict) and k in _VALUES:
                continue
            if isinstance(v, (dict, list)):
                node[k] = _copy_node(v, root)
                todo.append(node[k])
    return out


def _copy_node(v: Any, root: str) -> Any:
    if isinstance(v, list):
        return list(v)
    if not isinstance(v, dict):
        return v
    out = dict(v)
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a `required` output (None if it does not parse: cut by max_tokens)."""
    try:
        arr = json.loads(text)
    except ValueError:
        return None
    if not isinstance(arr, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in arr):
        return None
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in arr]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's tool call arguments as a dict (templates write
    `tool_call.arguments | tojson`), as vLLM and HF pass them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"]["arguments"])}}
                               for c in calls]
        out.append(m)
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
