"""IncrementalDetokenizer: output text of one request, token by token, UTF-8 safe, with stop strings.

Text is decoded over a sliding window (prefix_offset..read_offset, vLLM's scheme): a token that ends
in the middle of a multi-byte character decodes to U+FFFD, so nothing is emitted until the character
is complete. Stop strings are searched in the text; on a match the text is cut right before the stop
string (or right after it with include_stop_str_in_output). While running, `visible_text` holds
back the longest tail that could still grow into a stop string, so a stream never shows text that a
stop string later removes.
"""
from __future__ import annotations

from typing import Protocol

INITIAL_CONTEXT = 5  # prompt tokens decoded as context (leading spaces of SentencePiece-style tokens)


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stopped_by: str | None = None
        self._search_from = 0

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Feed one token; return the stop string if the text now hits one (text is then cut).
        check_stop=False (before min_tokens is reached) only extends the text."""
        self.ids.append(token_id)
        self._emit(final=False)
        return self._check_stop() if check_stop else None

    def flush(self) -> None:
        """At the end: emit whatever is left, even an incomplete character (as U+FFFD)."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            self._emit(final=True)

    def _emit(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._search_from = max(0, start - max((len(s) for s in self.stop), default=0) + 1)
        else:
            self._search_from = len(self.text)

    def _check_stop(self) -> str | None:
        if not self.stop or self.stopped_by is not None:
            return self.stopped_by
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, self._search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + (len(s) if self.include_stop else 0)]
        self.stopped_by = s
        return s

    def visible_text(self, finished: bool) -> str:
        """Text that is safe to show now: all of it once finished, else minus a possible stop prefix."""
        return self.text[: self.visible_length(finished)]

    def visible_length(self, finished: bool) -> int:
        """len(visible_text(finished)) without copying the text (a stream slices only what is new)."""
        if finished or not self.stop or self.stopped_by is not None:
            return len(self.text)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return len(self.text) - hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
