"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's flag and names): where a reasoning model's thinking ends.

  deepseek_r1  <think> ... </think> answer. The template may put <think> in the prompt (R1 distills, QwQ), so
               everything before </think> is thinking; with no </think> (cut by max_tokens) it is all thinking.
  qwen3        the same markers; with chat_template_kwargs {"enable_thinking": false} an output that does not
               open with <think> is all answer (Qwen3's template then writes an empty <think></think> block
               into the prompt itself).
  seed_oss     <seed:think> ... </seed:think>, deepseek_r1's rule (ByteDance Seed-OSS).
  minimax_m2   <think> ... </think>, deepseek_r1's rule (MiniMax-M2: the template opens the block).

What is shared by the engine and the server:
  - `ReasoningFormat.prompt_ends_reasoning(prompt text)`: the prompt already closed the thinking (the last
    marker in it is an end marker: Qwen3 with enable_thinking off), so the whole output is the answer;
  - `ThinkingGate`: fed the committed tokens one by one, it says when the end marker is complete. The engine
    holds a request's output constraint (structured outputs, forced tool calls) back until then, as vLLM does:
    the grammar constrains the answer, never the thinking (runtime/structured_outputs.py). Markers are matched
    on the tokens' text, so they work whether the tokenizer has them as single tokens or not;
  - `split_reasoning` (a finished text) and `ReasoningStream` (a text as it grows) -> (reasoning, answer), by
    the same rule: a start marker at the very beginning (after whitespace) is dropped, the thinking runs to the
    first end marker, the answer is what follows it. Both give the same split for the same text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from octavo.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    honours_enable_thinking: bool = False  # chat_template_kwargs enable_thinking=false means "no thinking"

    def prompt_ends_reasoning(self, prompt_text: str) -> bool:
        """The prompt's last reasoning marker is an end marker: the model answers straight away."""
        end = prompt_text.rfind(self.end)
        return end >= 0 and end > prompt_text.rfind(self.start)

    def thinking_disabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        kw = chat_template_kwargs or {}
        return self.honours_enable_thinking and kw.get("enable_thinking", True) is False


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>"),
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", honours_enable_thinking=True),
    "seed_oss": ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>"),
    "minimax_m2": ReasoningFormat("minimax_m2", "<think>", "</think>"),
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown reasoning parser {name!r}; choose one of "
                                  f"{', '.join(REASONING_PARSERS)}") from None


def split_reasoning(fmt: ReasoningFormat, text: str, *, answering: bool = False,
                    thinking_disabled: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a finished output; None where there is none. ANSWERING: the prompt ended the
    thinking (everything is answer); THINKING_DISABLED: an output that does not open with the start marker is
    all answer (qwen3 with enable_thinking false)."""
    st = ReasoningStream(fmt, answering=answering, thinking_disabled=thinking_disabled)
    r1, c1 = st.feed(text)
    r2, c2 = st.finish()
    reasoning, content = r1 + r2, c1 + c2
    return (None if st.plain else reasoning or None), content or None


@dataclass(slots=True)
class ReasoningStream:
    """One output's text as it grows -> (reasoning delta, answer delta) per piece. A tail that may be the
    beginning of a marker is held back until the next piece (or `finish`) decides it."""

    fmt: ReasoningFormat
    answering: bool = False
    thinking_disabled: bool = False
    state: str = "head"  # "head": nothing decided yet; "think": in the thinking; "answer": after it
    buf: str = ""
    plain: bool = False  # the whole output is answer (no thinking at all)

    def __post_init__(self) -> None:
        if self.answering:
            self.state, self.plain = "answer", True

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "answer":
            return "", text
        self.buf += text
        if self.state == "head":
            head = self.buf.lstrip()
            if not head or (self.fmt.start.startswith(head) and head != self.fmt.start):
                return "", ""  # could still be the start marker
            if head.startswith(self.fmt.start):
                self.buf = head[len(self.fmt.start):]
            elif self.thinking_disabled:
                self.state, self.plain, rest, self.buf = "answer", True, self.buf, ""
                return "", rest
            self.state = "think"
        i = self.buf.find(self.fmt.end)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(self.fmt.end):]
            self.buf, self.state = "", "answer"
            return reasoning, content
        keep = partial_suffix(self.buf, self.fmt.end)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back is thinking (or answer, for an undecided head with
        thinking disabled)."""
        rest, self.buf = self.buf, ""
        if self.state == "answer":
            return "", rest
        if self.state == "head" and self.thinking_disabled:
            self.state, self.plain = "answer", True
            return "", rest
        if self.state == "head":
            head = rest.lstrip()
            rest = head[len(self.fmt.start):] if head.startswith(self.fmt.start) else rest
            self.state = "think"
        return rest, ""


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of TEXT that is a proper prefix of MARKER."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass(slots=True)
class TokenPieces:
    """Each token id's own text (special tokens included), decoded once and kept: at most one entry per
    vocabulary token. Shared by the threads of one engine or server (a dict store is atomic)."""

    tokenizer: Any
    _cache: dict[int, str] = field(default_factory=dict)

    def __getitem__(self, token_id: int) -> str:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = piece
        return piece


@dataclass(slots=True)
class ThinkingGate:
    """Fed an output's tokens in order, it tells when the thinking has ended (the end marker is complete in
    their text). `ended` from the start when the prompt already ended it."""

    end: str
    pieces: TokenPieces
    ended: bool = False
    tokens: int = 0  # tokens fed before and including the one that completed the end marker
    _tail: str = ""

    def feed(self, token_id: int) -> bool:
        """Take one more token; True if this token completed the end marker."""
        if self.ended:
            return False
        self.tokens += 1
        text = self._tail + self.pieces[token_id]
        if self.end in text:
            self.ended, self._tail = True, ""
            return True
        self._tail = text[-(len(self.end) - 1):] if len(self.end) > 1 else ""
        return False


def markers_are_special(fmt: ReasoningFormat, tokenizer: Any) -> bool:
    """The tokenizer has a marker as a special token, which detokenizing with skip_special_tokens drops: the
    server then keeps special tokens in the text of chat outputs, or the split could not see the markers."""
    for marker in (fmt.start, fmt.end):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "" and \
                tokenizer.decode(ids, skip_special_tokens=False) == marker:
            return True
    return False


def prompt_ends_reasoning(fmt: ReasoningFormat, tokenizer: Any, prompt_ids: list[int]) -> bool:
    """The prompt PROMPT_IDS closed the thinking: its output is all answer."""
    return fmt.prompt_ends_reasoning(tokenizer.decode(list(prompt_ids), skip_special_tokens=False))


__all__ = ["REASONING_PARSERS", "ReasoningFormat", "ReasoningStream", "ThinkingGate", "TokenPieces",
           "get_reasoning_format", "markers_are_special", "prompt_ends_reasoning",
           "split_reasoning"]
