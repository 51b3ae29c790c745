"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens, over the chat machinery
(serving/chat_run.py), for the `anthropic` SDK and Claude-compatible tools.

The request becomes a chat: `system` (a string or text blocks) -> a system message; `messages` with string
content or blocks (text; `tool_use` in assistant turns -> tool calls; `tool_result` in user turns -> tool
messages); `tools` ({name, description, input_schema}) and `tool_choice` (auto / any / tool / none,
disable_parallel_tool_use); `max_tokens` (required, as Anthropic's), `stop_sequences`, `temperature`, `top_p`,
`top_k`. The reply is a `message` with text and `tool_use` blocks and a stop_reason (end_turn, max_tokens,
stop_sequence with the sequence, tool_use); with `stream`, Anthropic's events: message_start,
content_block_start, content_block_delta (text_delta / input_json_delta), content_block_stop, message_delta,
message_stop. count_tokens renders the same prompt and answers {"input_tokens"}.

Errors from these routes are in Anthropic's shape {"type": "error", "error": {"type", "message"}}; the API key
is also accepted as `x-api-key` (serving/app.py's auth). Images, documents and extended thinking are a 400.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from octavo.serving import sse
from octavo.serving.api_error import ApiError, bad_request
from octavo.serving.body import Body, show
from octavo.serving.chat_run import ChatRun, Piece
from octavo.serving.lora_models import resolve_model
from octavo.serving.protocol import ChatRequest, parse_chat
from octavo.serving.routes import read_json, read_request
from octavo.serving.state import STATE
from octavo.serving.tools import template_messages

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def anthropic_errors(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """HANDLER with its ApiErrors answered in Anthropic's error shape."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return web.json_response(error_body(err), status=err.status, headers=err.headers)
    return wrapped


def error_body(err: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


@anthropic_errors
async def messages(request: web.Request) -> web.StreamResponse:
    st, engine, body = await read_request(request)
    b = Body(body)
    req = parse_chat(to_chat(b, with_generation=True), st.limits)  # type: ignore[arg-type]
    model = resolve_model(st, engine, req.model, req.params)
    mid = f"msg_{secrets.token_hex(12)}"
    run = ChatRun(st, engine, req, mid)
    await run.start()
    out = _Message(mid, model)
    try:
        if b.boolean("stream", False):
            return await _stream(request, run, out)
        async for pieces in run.pieces():
            out.feed(pieces)
        out.finish(run)
        return web.json_response(out.message())
    finally:
        await run.close()


@anthropic_errors
async def count_tokens(request: web.Request) -> web.Response:
    st = request.app[STATE]
    engine = st.ready_engine()
    b = Body(await read_json(request))  # within the server's size and time limits
    req = parse_chat(to_chat(b, with_generation=False), st.limits)
    resolve_model(st, engine, req.model, req.params)
    ids = await asyncio.to_thread(_render, st, req)
    return web.json_response({"input_tokens": len(ids)})


def _render(st: Any, req: ChatRequest) -> list[int]:
    c = req.chat
    try:
        return st.tokenizer.encode_chat(template_messages(req.messages), c.add_generation_prompt,
                                        add_special_tokens=c.add_special_tokens,
                                        special_tokens_in_content=st.config.special_tokens_in_content,
                                        **({"tools": req.tools} if req.tools else {}))
    except Exception as exc:  # noqa: BLE001
        raise bad_request(f"cannot apply the chat template to these messages: {exc}") from None


async def _stream(request: web.Request, run: ChatRun, out: _Message) -> web.StreamResponse:
    resp = await sse.open_stream(request)
    try:
        await resp.write(_event("message_start", {"message": out.message(started=True, run=run)}))
        try:
            async for pieces in run.pieces():
                for kind, ev in out.feed(pieces):
                    await resp.write(_event(kind, ev))
        except ApiError as err:  # headers are out: Anthropic's in-band error event
            await resp.write(_event("error", {"error": error_body(err)["error"]}))
            return resp
        for kind, ev in out.finish(run):
            await resp.write(_event(kind, ev))
    except ConnectionResetError:
        log.debug("client disconnected from %s", request.path)
    return resp


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\n".encode() + sse.event({"type": kind, **data})


# ---------------------------------------------------------------------------------------------------
# request -> chat


def to_chat(b: Body, with_generation: bool) -> dict[str, Any]:
    """The chat completion body this Messages request asks for (parse_chat validates it afterwards)."""
    if b.present("thinking") and isinstance(b.d["thinking"], dict) and b.d["thinking"].get("type") == "enabled":
        raise bad_request("extended thinking is not supported by this server", "thinking", "unsupported_parameter")
    msgs: list[dict[str, Any]] = []
    system = b.d.get("system")
    if system is not None:
        text = _blocks_text(system, "system")
        if text:
            msgs.append({"role": "system", "content": text})
    raw = b.d.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(raw):
        msgs += _message(m, i)
    chat: dict[str, Any] = {"messages": msgs, "model": b.d.get("model")}
    if with_generation:
        max_tokens = b.integer("max_tokens", None, lo=1)
        if max_tokens is None:
            raise bad_request("'max_tokens' is required", "max_tokens")
        chat["max_tokens"] = max_tokens
        stops = b.d.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad_request("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
            if stops:
                chat["stop"] = stops
        for name in ("temperature", "top_p", "top_k"):
            if name in b.d:
                chat[name] = b.d[name]
        if b.present("temperature"):
            b.number("temperature", 1.0, lo=0.0, hi=1.0)
    tools = b.d.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = b.d.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice, bool(tools)))
    return chat


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (tool results become tool messages, before the turn's text)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request(f"'messages[{i}]' must be an object with role user or assistant", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"'messages[{i}].content' must be a string or a list of content blocks", "messages")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise bad_request(f"'{where}' (tool_use) needs a string 'id' and 'name' and an object 'input'",
                                  "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"'{where}' (tool_result) needs a string 'tool_use_id'", "messages")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _blocks_text(block.get("content", ""), where)})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad_request(f"'{where}': block type {show(kind)} is not supported here (text, tool_use in assistant "
                              "turns, tool_result in user turns; no images or documents)", "messages")
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _blocks_text(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)
                                   for x in v):
        return "".join(x["text"] for x in v)
    raise bad_request(f"'{where}' must be a string or a list of text blocks", where.split("[")[0].split(".")[0])


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {name, description, input_schema} objects", "tools")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict) \
                or t.get("type", "custom") not in ("custom", None):
            raise bad_request(f"'tools[{j}]' must be a client tool {{name, description, input_schema}} (server tools "
                              "are not supported)", "tools")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any, has_tools: bool) -> dict[str, Any]:
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none', ...}", "tool_choice")
    out: dict[str, Any] = {}
    if tc.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    kind = tc["type"]
    if not has_tools:
        if kind not in ("auto", "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return out
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise bad_request("'tool_choice' of type tool needs a 'name'", "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return out


# ---------------------------------------------------------------------------------------------------
# the reply


class _Message:
    """The reply's content blocks, built from pieces; feed/finish return the stream events they make."""

    def __init__(self, mid: str, model: str) -> None:
        self.mid, self.model = mid, model
        self.blocks: list[dict[str, Any]] = []
        self.args: dict[int, str] = {}  # block index -> a tool_use block's argument text so far
        self.calls: dict[int, int] = {}  # tool call index -> block index
        self.open: int | None = None  # the block being written
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    def message(self, started: bool = False, run: ChatRun | None = None) -> dict[str, Any]:
        if started and run is not None:
            self.usage["input_tokens"] = run.usage()[0]
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model,
                "content": [] if started else self.blocks, "stop_reason": None if started else self.stop_reason,
                "stop_sequence": None if started else self.stop_sequence,
                "usage": {**self.usage, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        block = self.blocks[i]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.args[i]) if self.args[i] else {}
            except json.JSONDecodeError:  # cut by max_tokens: what there is, as text, under a key
                block["input"] = {}
            if not isinstance(block["input"], dict):
                block["input"] = {"value": block["input"]}
        return [("content_block_stop", {"index": i})]

    def feed(self, pieces: list[Piece]) -> list[tuple[str, dict[str, Any]]]:
        evs: list[tuple[str, dict[str, Any]]] = []
        for p in pieces:
            if p.call is None:
                if not p.text:
                    continue
                if self.open is None or self.blocks[self.open]["type"] != "text":
                    evs += self._close()
                    self.open = len(self.blocks)
                    self.blocks.append({"type": "text", "text": ""})
                    evs.append(("content_block_start", {"index": self.open, "content_block": {"type": "text", "text": ""}}))
                self.blocks[self.open]["text"] += p.text
                evs.append(("content_block_delta", {"index": self.open, "delta": {"type": "text_delta", "text": p.text}}))
                continue
            if p.call not in self.calls:
                evs += self._close()
                self.open = self.calls[p.call] = len(self.blocks)
                tid = "toolu_" + (p.call_id or secrets.token_hex(12)).removeprefix("call_")
                self.blocks.append({"type": "tool_use", "id": tid, "name": p.name or "", "input": {}})
                self.args[self.open] = ""
                evs.append(("content_block_start", {"index": self.open, "content_block": dict(self.blocks[self.open])}))
            i = self.calls[p.call]
            if p.arguments:
                self.args[i] += p.arguments
                evs.append(("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                           "partial_json": p.arguments}}))
        return evs

    def finish(self, run: ChatRun) -> list[tuple[str, dict[str, Any]]]:
        evs = self._close()
        prompt, completion, cached = run.usage()
        self.usage = {"input_tokens": prompt, "output_tokens": completion}
        self.stop_reason = _STOP.get(run.finish_reason or "stop", "end_turn")
        if run.finish_reason == "stop" and isinstance(run.stop_reason, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", run.stop_reason
        return evs + [("message_delta", {"delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                                         "usage": {"output_tokens": completion}}),
                      ("message_stop", {})]


__all__ = ["count_tokens", "error_body", "messages", "to_chat"]
