"""Tool-call parsers (`octavo serve --tool-call-parser NAME`): a model's text -> content + tool calls.

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, after optional
               content (Hermes 2 Pro/3, Qwen 2.5/3, SmolLM3 and others that follow the format);
  llama3_json  the whole output is {"name": ..., "parameters": {...}} (or "arguments"), several
               separated by ';', optionally after <|python_tag|> (Llama 3.1/3.2/3.3's JSON tool calls).

`parse` reads a finished output. `streamer()` reads one as it grows: plain content is passed on at once,
except a tail that may be the start of a call; each call is emitted when it is complete (name and
arguments in one delta: OpenAI clients accumulate argument fragments, one fragment is a valid stream).
Text that looks like a call but does not parse stays content.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from octavo.serving.tools import ToolCall


@dataclass(slots=True)
class Parsed:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def _call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
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
        st = self.streamer()
        a, b = st.feed(text), st.finish()
        content = a.content + b.content
        return Parsed(content if content.strip() or not (a.calls or b.calls) else None, a.calls + b.calls)

    def streamer(self) -> HermesStreamer:
        return HermesStreamer()

    @classmethod
    def block_call(cls, block: str) -> ToolCall | None:
        """The call in one '<tool_call>...</tool_call>' block (the end tag may be missing), or None."""
        body = block.strip().removeprefix(cls.START).removesuffix(cls.END).strip()
        try:
            return _call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            return None


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class HermesStreamer:
    buf: str = ""  # text not yet passed on
    in_calls: bool = False  # a <tool_call> was seen: text between blocks is no longer content

    def feed(self, text: str) -> StreamDelta:
        self.buf += text
        out = StreamDelta()
        if not self.in_calls:
            i = self.buf.find(HermesParser.START)
            if i < 0:
                keep = _partial_suffix(self.buf, HermesParser.START)
                out.content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.content, self.buf, self.in_calls = self.buf[:i], self.buf[i:], True
        while True:  # complete blocks
            end = self.buf.find(HermesParser.END)
            if end < 0:
                break
            block, self.buf = self.buf[:end + len(HermesParser.END)], self.buf[end + len(HermesParser.END):]
            self._block(block, out)
            i = self.buf.find(HermesParser.START)  # text between calls is dropped (as vLLM does)
            if i >= 0:
                self.buf = self.buf[i:]
            else:
                keep = _partial_suffix(self.buf, HermesParser.START)
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

    @staticmethod
    def _block(block: str, out: StreamDelta) -> None:
        call = HermesParser.block_call(block)
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
            call = _call(obj, ("parameters", "arguments"))
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


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def get_parser(name: str) -> HermesParser | Llama3JsonParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}") from None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of TEXT that is a proper prefix of MARKER."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
