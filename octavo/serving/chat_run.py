"""One chat generation seen as a stream of `Piece`s (text, tool-call heads and argument deltas), for the APIs that
translate their requests into a chat: the Responses API (serving/openai_responses.py) and Anthropic's Messages
(serving/anthropic_messages.py).

`ChatRun.start()` renders the conversation with the chat template (off the event loop), starts a Generation and
waits for its first output, so a rejected prompt or a failed first step is still a plain error before any header
goes out; `pieces()` then yields what the generation adds, tool calls read as the chat route reads them
(serving/tool_output.py: a named function, required, or the server's --tool-call-parser for auto). n is 1.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from octavo.runtime.async_engine import AsyncEngine
from octavo.serving.api_error import bad_request
from octavo.serving.generation import ChoiceUpdate, Generation
from octavo.serving.protocol import ChatRequest
from octavo.serving.routes import engine_error, prepare_constraint, step_failed
from octavo.serving.state import ServerState
from octavo.serving.tool_output import ToolStream
from octavo.serving.tools import template_messages


@dataclass(slots=True)
class Piece:
    """What one update added: text, or a tool call's head (CALL index, ID and NAME) and/or an arguments delta."""

    text: str = ""
    call: int | None = None  # the tool call's index, when this piece belongs to a call
    call_id: str | None = None  # set on a call's first piece
    name: str | None = None  # set on a call's first piece
    arguments: str = ""


class ChatRun:
    def __init__(self, st: ServerState, engine: AsyncEngine, req: ChatRequest, rid: str) -> None:
        if req.params.n != 1:
            raise bad_request("this API makes one reply: n must be 1", "n")
        self.st, self.engine, self.req, self.rid = st, engine, req, rid
        self.gen: Generation | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string or token id that ended it, if one did
        self._tools = ToolStream(req.tool_choice, st.config.tool_call_parser, req.parallel_tool_calls) \
            if req.tools is not None and req.tool_choice.mode != "none" else None
        self._updates: AsyncIterator[list[ChoiceUpdate]] | Any = None
        self._first: list[ChoiceUpdate] | None = None

    async def start(self) -> None:
        """Tokenize, compile the output constraint, submit and wait for the first output (errors before headers)."""
        await prepare_constraint(self.engine, self.req)
        c = self.req.chat
        try:
            tools = {"tools": self.req.tools} if self.req.tools else {}
            ids = await asyncio.to_thread(
                self.st.tokenizer.encode_chat, template_messages(self.req.messages), c.add_generation_prompt,
                add_special_tokens=c.add_special_tokens,
                special_tokens_in_content=self.st.config.special_tokens_in_content, chat_template=c.chat_template,
                continue_final_message=c.continue_final_message, **c.chat_template_kwargs, **tools)
        except Exception as exc:  # noqa: BLE001 - no template, or a template that rejects these messages
            raise bad_request(f"cannot apply the chat template to these messages: {exc}") from None
        self.gen = Generation(self.engine, self.st.metrics, [{"prompt_token_ids": ids}], self.req.params, self.rid,
                              self.req.options.priority)
        self._updates = self.gen.updates()  # closing it aborts what is left of the request
        try:
            self._first = await anext(self._updates, None)
        except Exception as exc:  # noqa: BLE001
            await self.close()
            raise engine_error(exc) from None
        failed = next((u for u in self._first or () if u.finish_reason == "error"), None)
        if failed is not None:
            await self.close()
            raise step_failed(failed)

    async def close(self) -> None:
        if self._updates is not None:
            updates, self._updates = self._updates, None
            await updates.aclose()

    async def pieces(self) -> AsyncIterator[list[Piece]]:
        """Per engine output, what it added; `finish_reason` is set once the generation ends ("tool_calls" when
        calls were made). An engine error after the first output raises ApiError."""
        batch = self._first
        while batch is not None:
            out: list[Piece] = []
            for u in batch:
                if u.finish_reason == "error":
                    raise step_failed(u)
                out += self._feed(u)
            if out:
                yield out
            try:
                batch = await anext(self._updates, None)
            except Exception as exc:  # noqa: BLE001
                raise engine_error(exc) from None
        await self.close()

    def _feed(self, u: ChoiceUpdate) -> list[Piece]:
        if u.finish_reason is not None:
            self.stop_reason = u.stop_reason
        if self._tools is None or not self._tools.active:
            if u.finish_reason is not None:
                self.finish_reason = u.finish_reason
            return [Piece(text=u.text)] if u.text else []
        deltas = self._tools.feed(u.text)
        if u.finish_reason is not None:
            last, self.finish_reason = self._tools.finish(u.finish_reason)
            deltas += last
        out = []
        for d in deltas:
            if d.get("content"):
                out.append(Piece(text=d["content"]))
            for item in d.get("tool_calls", ()):
                fn = item.get("function", {})
                out.append(Piece(call=item["index"], call_id=item.get("id"), name=fn.get("name"),
                                 arguments=fn.get("arguments", "")))
        return out

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, prompt tokens from the prefix cache)."""
        g = self.gen
        return (g.prompt_tokens, g.completion_tokens, g.cached_tokens) if g is not None else (0, 0, 0)


__all__ = ["ChatRun", "Piece"]
