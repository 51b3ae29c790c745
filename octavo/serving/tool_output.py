"""A chat choice's text -> `message.tool_calls` / tool-call deltas, per the request's tool_choice.

  named function  the text IS the arguments (the output was constrained to its schema): one call, its
                  arguments streamed as they are generated;
  required        the text is a JSON array of {"name", "parameters"} (constrained): calls emitted when the
                  whole array is there;
  auto            the server's tool-call parser reads the text (content streamed, calls when complete);
  none            plain content.
finish_reason becomes "tool_calls" when the choice made calls (and it was not cut by max_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from octavo.serving.tool_parser_registry import call_id_maker, get_parser
from octavo.serving.tools import ToolCall, ToolChoice, calls_from_required


@dataclass(slots=True)
class WholeMessage:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def whole_message(choice: ToolChoice, parser_name: str | None, text: str, finish_reason: str | None,
                  parallel: bool = True, tools: list[dict[str, Any]] | None = None) -> WholeMessage:
    """The non-streamed message of one choice (TOOLS: the request's, which some parsers read)."""
    calls: list[ToolCall] = []
    content: str | None = text
    new_id = call_id_maker(parser_name)
    if finish_reason not in ("length", "abort", "error"):
        if choice.mode == "function":
            calls, content = [ToolCall(choice.name or "", text, new_id())], None
        elif choice.mode == "required":
            parsed = calls_from_required(text)
            if parsed:
                calls, content = parsed, None
                for c in calls:
                    c.id = new_id()
        elif choice.mode == "auto" and parser_name is not None:
            p = get_parser(parser_name, tools).parse(text)
            calls, content = p.calls, p.content
            if not parallel:
                calls = calls[:1]
    return WholeMessage(content, calls, "tool_calls" if calls else finish_reason)


@dataclass(slots=True)
class ToolStream:
    """One choice's streamed deltas: feed(text) per update, then finish(reason)."""

    choice: ToolChoice
    parser_name: str | None
    parallel: bool = True
    tools: list[dict[str, Any]] | None = None  # the request's (some parsers read their schemas)
    _streamer: Any = None
    _buf: str = ""  # required: the whole array
    _named_id: str | None = None
    num_calls: int = 0
    _content_seen: bool = False

    def __post_init__(self) -> None:
        if self.choice.mode == "auto" and self.parser_name is not None:
            self._streamer = get_parser(self.parser_name, self.tools).streamer()

    @property
    def active(self) -> bool:
        return self.choice.mode in ("function", "required") or self._streamer is not None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas ({"content": ...} / {"tool_calls": [...]}) for TEXT."""
        if not text:
            return []
        if self.choice.mode == "function":
            out = []
            if self._named_id is None:
                self._named_id = call_id_maker(self.parser_name)()
                out.append(self._call_delta(0, ToolCall(self.choice.name or "", "", self._named_id), with_head=True))
                self.num_calls = 1
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self.choice.mode == "required":
            self._buf += text
            return []
        if self._streamer is None:
            return [{"content": text}]
        return self._deltas(self._streamer.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason to send."""
        out: list[dict[str, Any]] = []
        cut = finish_reason in ("length", "abort", "error")
        if self.choice.mode == "required":
            calls = None if cut else calls_from_required(self._buf)
            if calls:
                for c in calls:
                    c.id = call_id_maker(self.parser_name)()
                    out.append(self._call_delta(self.num_calls, c, with_head=True))
                    self.num_calls += 1
            elif self._buf:
                out.append({"content": self._buf})
            self._buf = ""
        elif self._streamer is not None:
            out += self._deltas(self._streamer.finish())
        if cut and self.choice.mode != "function":
            return out, finish_reason
        return out, "tool_calls" if self.num_calls and not cut else finish_reason

    def _deltas(self, d: Any) -> list[dict[str, Any]]:
        out = []
        if d.content:
            out.append({"content": d.content})
        for c in d.calls:
            if self.num_calls and not self.parallel:
                break
            out.append(self._call_delta(self.num_calls, c, with_head=True))
            self.num_calls += 1
        return out

    @staticmethod
    def _call_delta(index: int, c: ToolCall, with_head: bool) -> dict[str, Any]:
        item: dict[str, Any] = {"index": index, "function": {"arguments": c.arguments}}
        if with_head:
            item.update(id=c.id, type="function")
            item["function"] = {"name": c.name, "arguments": c.arguments}
        return {"tool_calls": [item]}


def tool_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "reasoning": None}
    if calls:
        msg["tool_calls"] = [c.as_dict() for c in calls]
    return msg


