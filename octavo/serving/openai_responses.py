"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat machinery (serving/chat_run.py).

The request becomes a chat: `instructions` -> a system message; `input` (a string, or items: messages with
input_text / output_text parts, `function_call` and `function_call_output` items) -> messages, calls and tool
results; function `tools`, `tool_choice`, `parallel_tool_calls`; `text.format` (json_schema / json_object) ->
the chat's response_format; `max_output_tokens`, `temperature`, `top_p` (and vLLM's seed, top_k, min_p,
repetition_penalty). The reply is a Response object whose `output` holds a `message` item (output_text) and a
`function_call` item per call, or, with `stream`, the event sequence the openai SDK parses: response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta ...,
response.output_text.done, response.content_part.done, response.output_item.done (function calls:
response.function_call_arguments.delta / .done), then response.completed (response.incomplete when cut by
max_output_tokens).

Stateless: nothing is stored, `store` is answered false and `previous_response_id` / `conversation` are a 400
(send the whole conversation as `input`). No reasoning items: octavo has no reasoning parser.
"""
from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from aiohttp import web

from octavo.serving import sse
from octavo.serving.api_error import ApiError, bad_request
from octavo.serving.body import Body, show
from octavo.serving.chat_run import ChatRun, Piece
from octavo.serving.lora_models import resolve_model
from octavo.serving.protocol import parse_chat
from octavo.serving.routes import read_request

log = logging.getLogger(__name__)

_SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "priority")
_IGNORED = ("store", "metadata", "user", "include", "reasoning", "service_tier", "safety_identifier",
            "prompt_cache_key", "max_tool_calls", "truncation", "top_logprobs", "stream_options")
_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "tools", "tool_choice",
                     "parallel_tool_calls", "text", "stream", "previous_response_id", "conversation", "background",
                     "prompt", *_SAMPLING, *_IGNORED})
MAX_INPUT_ITEMS = 4096


async def create_response(request: web.Request) -> web.StreamResponse:
    st, engine, body = await read_request(request)
    b = Body(body)
    _check_fields(b, st)
    chat_body = to_chat(b)
    req = parse_chat(chat_body, st.limits)  # type: ignore[arg-type]
    model = resolve_model(st, engine, req.model, req.params)
    rid = f"resp_{secrets.token_hex(24)}"
    run = ChatRun(st, engine, req, rid)
    echo = _echo(b)
    await run.start()
    out = _Output(rid, int(time.time()), model, echo)
    try:
        if b.boolean("stream", False):
            return await _stream(request, run, out)
        async for pieces in run.pieces():
            out.feed(pieces)
        out.finish(run)
        return web.json_response(out.response())
    finally:
        await run.close()


async def _stream(request: web.Request, run: ChatRun, out: _Output) -> web.StreamResponse:
    resp = await sse.open_stream(request)
    try:
        for ev in out.opening():
            await resp.write(_event(ev))
        try:
            async for pieces in run.pieces():
                for ev in out.feed(pieces):
                    await resp.write(_event(ev))
        except ApiError as err:  # headers are out: an error event, as the SDK reads it
            await resp.write(_event(out.event("error", code=err.code, message=err.message, param=err.param)))
            return resp
        for ev in out.finish(run):
            await resp.write(_event(ev))
    except ConnectionResetError:
        log.debug("client disconnected from %s", request.path)
    return resp


def _event(ev: dict[str, Any]) -> bytes:
    return f"event: {ev['type']}\n".encode() + sse.event(ev)


# ---------------------------------------------------------------------------------------------------
# request -> chat


def _check_fields(b: Body, st: Any) -> None:
    if b.present("previous_response_id") or b.present("conversation"):
        name = "previous_response_id" if b.present("previous_response_id") else "conversation"
        raise ApiError(400, f"'{name}' is not supported: this server is stateless (responses are not stored); send "
                            "the whole conversation as 'input'", param=name, code="unsupported_parameter")
    if b.boolean("background", False):
        raise bad_request("'background' is not supported (responses are not stored)", "background",
                          "unsupported_parameter")
    if b.present("prompt"):
        raise bad_request("'prompt' (stored prompt templates) is not supported", "prompt", "unsupported_parameter")
    truncation = b.string("truncation", "disabled")
    if truncation != "disabled":
        raise bad_request("'truncation' must be 'disabled' (a prompt too long is a 400)", "truncation")
    if b.integer("top_logprobs", 0, lo=0, hi=20):
        raise bad_request("'top_logprobs' is not supported on /v1/responses", "top_logprobs", "unsupported_parameter")
    for name in b.d:
        if name not in _FIELDS and name not in st.limits.warned_fields:
            st.limits.warned_fields.add(name)
            log.warning("ignoring unknown request field %r (logged once)", name[:80])


def to_chat(b: Body) -> dict[str, Any]:
    """The chat completion body this Responses request asks for (validated by parse_chat afterwards)."""
    messages: list[dict[str, Any]] = []
    instructions = b.string("instructions", None)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += _messages(b.d.get("input"))
    chat: dict[str, Any] = {"messages": messages, "model": b.d.get("model")}
    for name in _SAMPLING:
        if name in b.d:
            chat[name] = b.d[name]
    if b.present("max_output_tokens"):
        chat["max_completion_tokens"] = b.integer("max_output_tokens", None, lo=1)
    tools = b.d.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
        if not chat["tools"]:
            del chat["tools"]
    if b.present("tool_choice") and "tools" in chat:
        chat["tool_choice"] = _tool_choice(b.d["tool_choice"])
    elif b.present("tool_choice") and b.d["tool_choice"] not in ("none", "auto"):
        raise bad_request("'tool_choice' needs function 'tools'", "tool_choice")
    if "parallel_tool_calls" in b.d:
        chat["parallel_tool_calls"] = b.d["parallel_tool_calls"]
    fmt = _text_format(b.d.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def _messages(inp: Any) -> list[dict[str, Any]]:
    if isinstance(inp, str):
        if not inp:
            raise bad_request("'input' must not be empty", "input")
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise bad_request("'input' must be a string or a non-empty list of input items", "input")
    if len(inp) > MAX_INPUT_ITEMS:
        raise bad_request(f"'input' may hold at most {MAX_INPUT_ITEMS} items, got {len(inp)}", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(inp):
        if not isinstance(item, dict):
            raise bad_request(f"'input[{i}]' must be an object (a message or a function_call(_output) item)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"'input[{i}].role' must be user, assistant, system or developer, got {show(role)}",
                                  "input")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(x, str) for x in (name, args, call_id)):
                raise bad_request(f"'input[{i}]' (function_call) needs string 'call_id', 'name' and 'arguments'",
                                  "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, (str, list)):
                raise bad_request(f"'input[{i}]' (function_call_output) needs a string 'call_id' and 'output'", "input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, i)})
        elif kind == "reasoning":
            continue  # a reasoning item from an earlier turn: nothing to render
        else:
            raise bad_request(f"'input[{i}].type' {show(kind)} is not supported (message, function_call, "
                              "function_call_output)", "input")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"'input[{i}].content' parts must be input_text / output_text with a string 'text' "
                                  "(images, audio and files are not supported)", "input")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'input[{i}].content' must be a string or a list of text parts", "input")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise bad_request(f"'tools[{j}]': only function tools are supported, got {show(kind)}", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any) -> Any:
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise bad_request("'text' must be {'format': {'type': 'text' | 'json_object' | 'json_schema', ...}}", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    raise bad_request(f"'text.format.type' must be text, json_object or json_schema, got {show(fmt.get('type'))}",
                      "text")


def _echo(b: Body) -> dict[str, Any]:
    """The request's settings a Response object repeats."""
    fmt = b.d.get("text") if isinstance(b.d.get("text"), dict) else None
    return {
        "instructions": b.d.get("instructions"), "max_output_tokens": b.d.get("max_output_tokens"),
        "temperature": b.d.get("temperature", 1.0), "top_p": b.d.get("top_p", 1.0),
        "tools": b.d.get("tools") or [], "tool_choice": b.d.get("tool_choice", "auto"),
        "parallel_tool_calls": b.d.get("parallel_tool_calls", True),
        "text": {"format": (fmt or {}).get("format") or {"type": "text"}},
        "metadata": b.d.get("metadata") or {}, "user": b.d.get("user"),
    }


# ---------------------------------------------------------------------------------------------------
# output items and events


class _Output:
    """The Response's output items, built from pieces; each step returns the stream events it makes."""

    def __init__(self, rid: str, created: int, model: str, echo: dict[str, Any]) -> None:
        self.rid, self.created, self.model, self.echo = rid, created, model, echo
        self.items: list[dict[str, Any]] = []
        self.open_message: int | None = None  # output index of the message being written
        self.calls: dict[int, int] = {}  # tool call index -> output index
        self.open_calls: list[int] = []
        self.seq = 0
        self.status, self.incomplete, self.usage = "in_progress", None, None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def response(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "response", "created_at": self.created, "model": self.model,
                "status": self.status, "error": None, "incomplete_details": self.incomplete,
                "output": self.items, "usage": self.usage, "store": False, "previous_response_id": None,
                "reasoning": None, "truncation": "disabled", "background": False, **self.echo}

    def opening(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def feed(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        evs: list[dict[str, Any]] = []
        for p in pieces:
            if p.call is None:
                evs += self._text(p.text)
            else:
                evs += self._call(p)
        return evs

    def _text(self, text: str) -> list[dict[str, Any]]:
        evs = []
        if self.open_message is None:
            evs += self._close_calls()
            self.open_message = len(self.items)
            item = {"id": f"msg_{secrets.token_hex(24)}", "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            self.items.append(item)
            evs.append(self.event("response.output_item.added", output_index=self.open_message, item=dict(item, content=[])))
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            evs.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open_message,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        item = self.items[self.open_message]
        if text:
            item["content"][0]["text"] += text
            evs.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.open_message,
                                  content_index=0, delta=text, logprobs=[]))
        return evs

    def _close_message(self) -> list[dict[str, Any]]:
        if self.open_message is None:
            return []
        i, self.open_message = self.open_message, None
        item = self.items[i]
        part = item["content"][0]
        item["status"] = "completed"
        return [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                           part={"type": "output_text", "text": part["text"], "annotations": []}),
                self.event("response.output_item.done", output_index=i, item=item)]

    def _call(self, p: Piece) -> list[dict[str, Any]]:
        evs = []
        if p.call not in self.calls:
            evs += self._close_message()
            i = len(self.items)
            self.calls[p.call] = i  # type: ignore[index]
            self.open_calls.append(i)
            item = {"id": f"fc_{secrets.token_hex(24)}", "type": "function_call", "status": "in_progress",
                    "call_id": p.call_id or f"call_{secrets.token_hex(12)}", "name": p.name or "", "arguments": ""}
            self.items.append(item)
            evs.append(self.event("response.output_item.added", output_index=i, item=dict(item)))
        i = self.calls[p.call]  # type: ignore[index]
        item = self.items[i]
        if p.arguments:
            item["arguments"] += p.arguments
            evs.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                  delta=p.arguments))
        return evs

    def _close_calls(self) -> list[dict[str, Any]]:
        evs = []
        for i in self.open_calls:
            item = self.items[i]
            item["status"] = "completed"
            evs.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"]))
            evs.append(self.event("response.output_item.done", output_index=i, item=item))
        self.open_calls = []
        return evs

    def finish(self, run: ChatRun) -> list[dict[str, Any]]:
        evs = self._text("") if not self.items else []  # no output at all: an empty message, as OpenAI's
        evs += self._close_message() + self._close_calls()
        prompt, completion, cached = run.usage()
        self.usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + completion}
        if run.finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return evs + [self.event(kind, response=self.response())]


__all__ = ["create_response", "to_chat"]
