"""The seed's ten requests (/work/shared/workloads/seed10.json): same kinds, same generation lengths.

Prompt token counts depend on the tokenizer (and on the chat template, which the instruct model needs to
answer sensibly), so they differ from the seed's; the generation lengths are the seed's, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

from octavo.runtime.tokenizer import Tokenizer

Message = dict[str, str]

FOX = " ".join(["The quick brown fox jumps over the lazy dog."] * 50)

MULTI_TURN: list[Message] = [
    {"role": "user", "content": "I want to plan a picnic this weekend."},
    {"role": "assistant", "content": "That sounds lovely! Where would you like to go, and how many people are coming?"},
    {"role": "user", "content": "To the park by the river, with four friends. What food should I bring?"},
    {"role": "assistant", "content": "Sandwiches, fresh fruit, a salad, some cheese and crackers, and plenty of "
                                     "water or lemonade are easy to carry and share."},
    {"role": "user", "content": "Great. It might rain a little in the afternoon, though."},
    {"role": "assistant", "content": "Then bring a light tarp or a couple of umbrellas, and pick a spot near the "
                                     "trees or the pavilion so you can move under cover quickly."},
    {"role": "user", "content": "Good idea. And what games could we play there?"},
]


@dataclass(frozen=True, slots=True)
class Profile:
    seq: int  # the seed's sequence number, used as the request id
    kind: str
    messages: tuple[Message, ...]  # a conversation; single-turn kinds have one user message
    max_tokens: int  # the seed's generation length

    @property
    def id(self) -> str:
        return str(self.seq)


def _user(text: str) -> tuple[Message, ...]:
    return ({"role": "user", "content": text},)


SEED_PROFILES: tuple[Profile, ...] = (
    Profile(6, 'Short answer ("42")', _user("What is 6 times 7?"), 4),
    Profile(4, "Long context (fox dog x50)", _user(FOX + "\n\nWhich animal jumps over the dog?"), 8),
    Profile(2, "Short Q&A", _user("What is the capital of France?"), 16),
    Profile(9, "Translation", _user("Translate to French: Good morning, my friend."), 16),
    Profile(8, "Math problem", _user("A train travels 60 km in 45 minutes. What is its speed in km/h?"), 24),
    Profile(3, "Medium Q&A", _user("Why is the sky blue?"), 32),
    Profile(11, "Multi-turn chat", tuple(MULTI_TURN), 32),
    Profile(5, "Code generation", _user("Write a Python function that checks whether a number is prime."), 48),
    Profile(10, "Long generation", _user("Tell me a story about a robot who learns to paint."), 48),
    Profile(7, "Essay", _user("Write a short essay about why the invention of the printing press mattered."), 64),
)


def plain_text(messages: tuple[Message, ...] | list[Message]) -> str:
    """A conversation as plain text, for models without a chat template (or --no-chat-template)."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def prompt_ids(tokenizer: Tokenizer, messages: tuple[Message, ...] | list[Message], use_chat_template: bool = True) -> list[int]:
    """Token ids of a conversation: through the model's chat template when it has one (and asked to)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.encode_chat(list(messages))
    return tokenizer.encode(plain_text(messages))
