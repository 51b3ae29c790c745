"""IncrementalDetokenizer: output text of one request, token by token, UTF-8 safe, with stop strings.

Text is decoded over a sliding window (prefix_offset..read_offset, vLLM's scheme): a token that ends
in the middle of a multi-byte character decodes to U+FFFD, so nothing is emitted until the character
is complete. Stop strings are searched in the text; on a match the text is cut right before the stop
string (or right after it with include_stop_str_in_output). While running, `visible_text` holds
back the longest tail that could still grow into a stop string, so a stream never shows text that a
stop string later removes.

The text grows as a list of pieces, not by `str +=` (which copies the whole text at every token: quadratic in
the output length, seconds of copying at 100k tokens): a stop search, the stop-prefix hold-back and a stream's
delta (`slice`) touch only the tail they need; `text` joins the pieces once per read and keeps the result.
"""
from __future__ import annotations

from bisect import bisect_right
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
        self._pieces: list[str] = []  # the text, in the pieces it was emitted in (joined by `text`)
        self._starts: list[int] = []  # where each piece starts in the text
        self._length = 0
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.stopped_by: str | None = None
        self._search_from = 0

    @property
    def text(self) -> str:
        """The whole text so far (joined once after each change, then kept as one piece)."""
        if len(self._pieces) != 1:
            joined = "".join(self._pieces)
            self._pieces, self._starts = ([joined], [0]) if joined else ([], [])
        return self._pieces[0] if self._pieces else ""

    @property
    def length(self) -> int:
        """len(text), without joining it."""
        return self._length

    def slice(self, start: int, end: int) -> str:
        """text[start:end] for 0 <= start, joining only the pieces that overlap it."""
        end = min(end, self._length)
        if start >= end:
            return ""
        i = bisect_right(self._starts, start) - 1
        parts = []
        pos = start
        while pos < end:
            piece, first = self._pieces[i], self._starts[i]
            parts.append(piece[pos - first:end - first])
            pos = first + len(piece)
            i += 1
        return "".join(parts)

    def _append(self, piece: str) -> None:
        if piece:
            self._starts.append(self._length)
            self._pieces.append(piece)
            self._length += len(piece)

    def _truncate(self, length: int) -> None:
        """Cut the text to its first LENGTH characters."""
        if length >= self._length:
            return
        if length <= 0:
            self._pieces, self._starts, self._length = [], [], 0
            return
        i = bisect_right(self._starts, length) - 1  # the piece holding character length - 1 (or starting at length)
        keep = length - self._starts[i]
        self._pieces = self._pieces[:i] + ([self._pieces[i][:keep]] if keep else [])
        self._starts = self._starts[:len(self._pieces)]
        self._length = length

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
            start = self._length
            self._append(full[len(prefix):])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._search_from = max(0, start - self._longest_stop + 1)
        else:
            self._search_from = self._length

    def _check_stop(self) -> str | None:
        if not self.stop or self.stopped_by is not None:
            return self.stopped_by
        tail = self.slice(self._search_from, self._length)  # the new text and a stop's length before it
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = tail.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._truncate(self._search_from + i + (len(s) if self.include_stop else 0))
        self.stopped_by = s
        return s

    def visible_text(self, finished: bool) -> str:
        """Text that is safe to show now: all of it once finished, else minus a possible stop prefix."""
        return self.slice(0, self.visible_length(finished))

    def visible_length(self, finished: bool) -> int:
        """len(visible_text(finished)) without copying the text (a stream slices only what is new)."""
        if finished or not self.stop or self.stopped_by is not None:
            return self._length
        tail = self.slice(max(0, self._length - self._longest_stop), self._length)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), hold, -1):
                if tail.endswith(s[:k]):
                    hold = k
                    break
        return self._length - hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
