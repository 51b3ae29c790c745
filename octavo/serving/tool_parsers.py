"""Tool-call parsers (`octavo serve --tool-call-parser NAME`): a model's text -> content + tool calls.

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, after optional
               content (Hermes 2 Pro/3, Qwen 2.5/3, SmolLM3 and others that follow the format);
  llama3_json  the whole output is {"name": ..., "parameters": {...}} (or "arguments"), several
               separated by ';', optionally after <|python_tag|> (Llama 3.1/3.2/3.3's JSON tool calls).

`parse` reads a finished output. `streamer()` reads one as it grows: plain content is passed on at once,
except a tail that may be the start of a call; each call is emitted when it is complete (name and
arguments in one delta: OpenAI clients accumulate argument fragments, one fragment is a valid stream).
Text that looks like a call but does not parse stays content. The other formats have a module each
(tool_parser_mistral.py, tool_parser_pythonic.py, tool_parser_qwen3_coder.py); the names are in
tool_parser_registry.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from octavo.runtime.reasoning import partial_suffix
from octavo.serving.tools import ToolCall


@dataclass(slots=True)
class Parsed:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def call_of(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Parsed:
        """Calls of the well-formed blocks; content is the text before the first block plus any block that
        does not parse (what the streamer sends, by construction)."""
        return whole(self.streamer(), text)

    def streamer(self) -> BlockStreamer:
        return BlockStreamer(self.START, self.END, self.block_call)

    @classmethod
    def block_call(cls, block: str) -> ToolCall | None:
        """The call in one '<tool_call>...</tool_call>' block (the end tag may be missing), or None."""
        body = block.strip().removeprefix(cls.START).removesuffix(cls.END).strip()
        try:
            return call_of(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            return None


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def whole(streamer: Any, text: str) -> Parsed:
    """A finished output read by a fresh STREAMER: what a stream of it sends, by construction. Content that is
    only whitespace beside calls is none."""
    a, b = streamer.feed(text), streamer.finish()
    content = a.content + b.content
    return Parsed(content if content.strip() or not (a.calls or b.calls) else None, a.calls + b.calls)


@dataclass(slots=True)
class BlockStreamer:
    """Calls written as START ... END blocks after optional content (hermes, qwen3_coder): READ gives the call
    of one whole block (its END may be missing at the end of the output), or None (then it stays content)."""

    start: str
    end: str
    read: Callable[[str], ToolCall | None]
    buf: str = ""  # text not yet passed on
    in_calls: bool = False  # a start marker was seen: text between blocks is no longer content

    def feed(self, text: str) -> StreamDelta:
        self.buf += text
        out = StreamDelta()
        if not self.in_calls:
            i = self.buf.find(self.start)
            if i < 0:
                keep = partial_suffix(self.buf, self.start)
                out.content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.content, self.buf, self.in_calls = self.buf[:i], self.buf[i:], True
        while True:  # complete blocks
            end = self.buf.find(self.end)
            if end < 0:
                break
            block, self.buf = self.buf[:end + len(self.end)], self.buf[end + len(self.end):]
            self._block(block, out)
            i = self.buf.find(self.start)  # text between calls is dropped (as vLLM does)
            if i >= 0:
                self.buf = self.buf[i:]
            else:
                keep = partial_suffix(self.buf, self.start)
                self.buf = self.buf[len(self.buf) - keep:] if keep else ""
        return out

    def finish(self) -> StreamDelta:
        """The end of the output: an unclosed last block is parsed as is."""
        rest, self.buf = self.buf, ""
        out = StreamDelta()
        if not self.in_calls:
            out.content = rest
        elif rest.strip():
            self._block(rest, out)
        return out

    def _block(self, block: str, out: StreamDelta) -> None:
        call = self.read(block)
        if call is not None:
            out.calls.append(call)
        else:  # not a well-formed call: the model's text, as is
            out.content += block


class Llama3JsonParser:
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return Parsed(text)
        dec = json.JSONDecoder()
        calls, i = [], 0
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return Parsed(text)
            call = call_of(obj, ("parameters", "arguments"))
            if call is None:
                return Parsed(text)
            calls.append(call)
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return Parsed(None, calls)

    def streamer(self) -> Llama3Streamer:
        return Llama3Streamer(self)


@dataclass(slots=True)
class Llama3Streamer:
    parser: Llama3JsonParser
    buf: str = ""
    mode: str = "undecided"  # "content" once the output is plain text, "json" while it may be calls

    def feed(self, text: str) -> StreamDelta:
        if self.mode == "content":
            return StreamDelta(content=text)
        self.buf += text
        head = self.buf.lstrip()
        if not head or Llama3JsonParser.PYTHON_TAG.startswith(head):
            return StreamDelta()
        if head.startswith("{") or head.startswith(Llama3JsonParser.PYTHON_TAG):
            self.mode = "json"
            return StreamDelta()
        self.mode, rest, self.buf = "content", self.buf, ""
        return StreamDelta(content=rest)

    def finish(self) -> StreamDelta:
        rest, self.buf = self.buf, ""
        if self.mode != "json":
            return StreamDelta(content=rest)
        parsed = self.parser.parse(rest)
        return StreamDelta(calls=parsed.calls) if parsed.calls else StreamDelta(content=rest)
