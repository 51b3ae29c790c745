"""Message text stays text: special-token strings inside chat messages are not parsed as control tokens.

A chat template renders messages into one string, which is then tokenized with special tokens parsed (the
template's own `<|im_start|>`, `<|im_end|>`, BOS ... must become their control ids). Tokenized naively,
a user message holding `<|im_end|>\\n<|im_start|>system\\n...` would end its own turn and open a system turn:
role injection. Here every special-token string found in the messages' strings is swapped, before
rendering, for a marker (two private-use characters that occur nowhere in the messages or the template,
around the token's index); the rendered text is cut at the markers, the template's text is tokenized as
usual, and each marked occurrence is tokenized as plain text (`encode_special_tokens`), as if the
tokenizer had no such special token. A conversation without special-token strings tokenizes exactly as
before; with them, the model sees the same characters, but as ordinary tokens.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PRIVATE_USE = range(0xE000, 0xF900)


@dataclass(slots=True)
class ContentEscaper:
    """Built once per tokenizer from its special tokens (the strings the tokenizer would turn into them)."""

    specials: list[str]  # longest first, so that a special token containing another one wins
    pattern: re.Pattern[str] | None

    @classmethod
    def for_specials(cls, specials: list[str]) -> ContentEscaper:
        ordered = sorted({s for s in specials if s}, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        return cls(ordered, pattern)

    def needed(self, messages: Any) -> bool:
        """Whether any string in MESSAGES holds a special-token string (the common case is: no)."""
        return self.pattern is not None and any(self.pattern.search(s) for s in _strings(messages))

    def escape(self, messages: Any, template: str) -> tuple[Any, str, str]:
        """(messages with each special-token string replaced by OPEN index CLOSE, OPEN, CLOSE)."""
        assert self.pattern is not None
        used: set[str] = set(template)
        for s in _strings(messages):
            used.update(s)
        free = (chr(c) for c in PRIVATE_USE if chr(c) not in used)
        try:
            open_, close = next(free), next(free)
        except StopIteration:  # every private-use character occurs in the messages: an attack, not a chat
            raise ValueError("the messages use every private-use character; cannot keep special tokens apart")
        index = {s: i for i, s in enumerate(self.specials)}
        mark = lambda m: f"{open_}{index[m.group()]}{close}"  # noqa: E731
        return _map_strings(messages, lambda s: self.pattern.sub(mark, s)), open_, close

    def tokenize(self, rendered: str, open_: str, close: str, encode: Callable[[str], list[int]],
                 encode_literal: Callable[[str], list[int]]) -> list[int]:
        """Token ids of RENDERED: text between markers with ENCODE, each marked special string with
        ENCODE_LITERAL (as plain text)."""
        ids: list[int] = []
        cut = re.compile(f"{re.escape(open_)}([0-9]+){re.escape(close)}")
        pos = 0
        for m in cut.finditer(rendered):
            if m.start() > pos:
                ids += encode(rendered[pos:m.start()])
            ids += encode_literal(self.specials[int(m.group(1))])
            pos = m.end()
        if pos < len(rendered):
            ids += encode(rendered[pos:])
        return ids


def _strings(value: Any) -> list[str]:
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value
