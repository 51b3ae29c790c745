"""A chat choice's thinking apart from its answer, with the server's reasoning parser (`--reasoning-parser`).

  message.reasoning_content / message.reasoning   the thinking (vLLM's two names for it; null if none),
  message.content                                  only the answer (null while there is none),
  delta.reasoning_content / delta.reasoning        thinking as it streams; answer deltas are `content`,
  usage.completion_tokens_details.reasoning_tokens tokens up to and including the end marker.
Tool-call parsing and forced tool calls read the answer only. The split is runtime/reasoning.py's, the same for
a whole response and for a stream; a prompt that already closed the thinking (the template did, e.g. Qwen3 with
enable_thinking false) makes the whole output the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from octavo.runtime.reasoning import ReasoningFormat, ReasoningStream, ThinkingGate, TokenPieces


@dataclass(slots=True)
class ChoiceReasoning:
    """One choice's split: text pieces in, (thinking, answer) pieces out; its reasoning tokens counted."""

    stream: ReasoningStream
    gate: ThinkingGate

    @classmethod
    def new(cls, fmt: ReasoningFormat, pieces: TokenPieces, answering: bool, thinking_disabled: bool
            ) -> ChoiceReasoning:
        return cls(ReasoningStream(fmt, answering=answering, thinking_disabled=thinking_disabled),
                   ThinkingGate(fmt.end, pieces, ended=answering))

    def feed(self, text: str, token_ids: list[int], last: bool) -> tuple[str, str]:
        """(thinking, answer) added by TEXT (and, when LAST, what was held back)."""
        for t in token_ids:
            self.gate.feed(t)
        reasoning, content = self.stream.feed(text)
        if last:
            r, c = self.stream.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    @property
    def reasoning_tokens(self) -> int:
        return 0 if self.stream.plain else self.gate.tokens


@dataclass(slots=True)
class ChatReasoning:
    """The reasoning state of one chat response (all its choices)."""

    fmt: ReasoningFormat
    pieces: TokenPieces
    answering: bool  # the prompt closed the thinking
    thinking_disabled: bool  # chat_template_kwargs enable_thinking false, for a parser that honours it
    choices: dict[int, ChoiceReasoning] = field(default_factory=dict)

    def choice(self, index: int) -> ChoiceReasoning:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = ChoiceReasoning.new(self.fmt, self.pieces, self.answering,
                                                          self.thinking_disabled)
        return c

    def whole(self, index: int, text: str, token_ids: list[int]) -> tuple[str | None, str | None]:
        """(thinking, answer) of a finished choice; None where there is none."""
        reasoning, content = self.choice(index).feed(text, token_ids, last=True)
        plain = self.choice(index).stream.plain
        return (None if plain else reasoning or None), content or None

    @property
    def reasoning_tokens(self) -> int:
        return sum(c.reasoning_tokens for c in self.choices.values())


def with_reasoning(message: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    """MESSAGE (a whole message or a delta) carrying REASONING under both of vLLM's names."""
    message["reasoning_content"] = reasoning
    message["reasoning"] = reasoning
    return message


__all__ = ["ChatReasoning", "ChoiceReasoning", "with_reasoning"]
