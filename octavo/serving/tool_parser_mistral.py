"""The `mistral` tool-call parser (vLLM's name): Mistral's [TOOL_CALLS] calls, after optional content.

  older tokenizers (v3, Mistral 7B v0.3, Mixtral, Nemo):  [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
  v11 and later (Mistral Small 3.2, Magistral, Devstral): [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}
                                                          (a [CALL_ID]id between name and [ARGS] is read too)
Each call goes out when it is complete: a call of the newer form when its arguments' JSON closes, the older
form's calls when the array closes. A call part that does not parse, with everything after it, stays content.
Call ids are 9 letters and digits, as Mistral's chat templates require of the tool_call_id they get back.
The markers are special tokens: with this parser a request that has tools keeps special tokens in its text
(vLLM does the same), so the parser sees them.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from octavo.runtime.reasoning import partial_suffix
from octavo.serving.tool_parsers import Parsed, StreamDelta, call_of, whole
from octavo.serving.tools import ToolCall

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class MistralParser:
    name = "mistral"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        pass

    def parse(self, text: str) -> Parsed:
        return whole(self.streamer(), text)

    def streamer(self) -> MistralStreamer:
        return MistralStreamer()


@dataclass(slots=True)
class MistralStreamer:
    buf: str = ""  # text not yet passed on (after the first [TOOL_CALLS]: the call part being read)
    in_calls: bool = False
    failed: bool = False  # a call part did not parse: the rest is content

    def feed(self, text: str) -> StreamDelta:
        if self.failed:
            return StreamDelta(content=text)
        self.buf += text
        out = StreamDelta()
        if not self.in_calls:
            i = self.buf.find(TOOL_CALLS)
            if i < 0:
                keep = partial_suffix(self.buf, TOOL_CALLS)
                out.content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.content, self.buf, self.in_calls = self.buf[:i], self.buf[i + len(TOOL_CALLS):], True
        elif "}" not in text and "]" not in text:
            return out  # no call can have completed (a call's JSON ends with one of these): not re-read
        self._calls(out, final=False)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.in_calls and not self.failed:
            self._calls(out, final=True)
        out.content += self.buf
        self.buf = ""
        return out

    def _calls(self, out: StreamDelta, final: bool) -> None:
        """Take every complete call off the front of buf."""
        dec = json.JSONDecoder()
        while True:
            part = self.buf.lstrip()
            if not part:
                return
            if part.startswith(TOOL_CALLS):
                self.buf = part[len(TOOL_CALLS):]
                continue
            if part.startswith("["):  # the older form: one JSON array of calls
                try:
                    arr, end = dec.raw_decode(part)
                except ValueError:
                    if final:
                        self._fail(out)
                    return
                calls = [call_of(o, ("arguments", "parameters")) for o in arr] if isinstance(arr, list) else [None]
                if not calls or any(c is None for c in calls):
                    self._fail(out)
                    return
                out.calls += [_mistral_id(c) for c in calls if c is not None]
                self.buf = part[end:]
                continue
            a = part.find(ARGS)
            if a < 0:
                if final or not _may_be_name(part):
                    self._fail(out)
                return
            name = part[:a].split(CALL_ID)[0].strip()
            try:
                args, end = dec.raw_decode(part, a + len(ARGS))
            except ValueError:
                after = part[a + len(ARGS):].lstrip()
                if final or (after and not after.startswith("{")):
                    self._fail(out)
                return
            call = call_of({"name": name, "arguments": args}, ("arguments",)) if name else None
            if call is None:
                self._fail(out)
                return
            out.calls.append(_mistral_id(call))
            self.buf = part[end:]

    def _fail(self, out: StreamDelta) -> None:
        out.content += TOOL_CALLS + self.buf
        self.buf, self.failed = "", True


def _may_be_name(part: str) -> bool:
    """PART can still become 'name[ARGS]' (or 'name[CALL_ID]id[ARGS]')."""
    if CALL_ID in part:
        name = part.split(CALL_ID)[0]
    else:
        name = part[:len(part) - max(partial_suffix(part, ARGS), partial_suffix(part, CALL_ID))]
    return all(ch.isalnum() or ch in "_-." for ch in name)


def _mistral_id(call: ToolCall) -> ToolCall:
    call.id = mistral_call_id()
    return call


__all__ = ["MistralParser", "mistral_call_id"]
