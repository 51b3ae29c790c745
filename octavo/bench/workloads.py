"""Benchmark workloads: lists of BenchRequest (prompt, max_tokens, ignore_eos) built deterministically.

- random:        seeded prompt/output lengths around --input-len/--output-len (± --range-ratio). With a
                 vocabulary the prompts are random token ids of exactly that length; without one they
                 are random words (about one token per word).
- seed10:        the seed document's 10-request mix (its generation lengths; prompts of the same kind,
                 written here), the profile embedded below.
- shared-prefix: many requests behind one long shared system prompt (exercises the prefix cache).
- a JSONL file:  {"prompt": str | [ids], "max_tokens": int, "ignore_eos"?: bool} per line.
Fixed output lengths use ignore_eos, so every request generates exactly max_tokens tokens.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from octavo.errors import InvalidRequestError


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    ignore_eos: bool = True
    label: str = ""


@dataclass(slots=True)
class Vocab:
    """What the random workload needs to draw token ids: the vocabulary size and ids to avoid."""

    size: int
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def from_tokenizer_file(cls, path: str | Path) -> Vocab:
        """From a tokenizer.json (HF `tokenizers`), e.g. inside an export folder."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return cls(tok.get_vocab_size(with_added_tokens=True), frozenset(tok.get_added_tokens_decoder()))


# The seed's trace: (kind, the seed's prompt tokens, generation tokens, a prompt of that kind).
SEED10: tuple[tuple[str, int, int, str], ...] = (
    ("Short answer (\"42\")", 2, 4, "6*7="),
    ("Long context (fox dog x50)", 507, 8, "The quick brown fox jumps over the lazy dog. " * 50),
    ("Short Q&A", 7, 16, "What is the capital of France?"),
    ("Translation", 10, 16, "Translate to French: good morning, how are you?"),
    ("Math problem", 14, 24, "Solve for x: if 3x + 5 = 20, what is the value of x?"),
    ("Medium Q&A", 9, 32, "Why do operating systems use virtual memory paging?"),
    ("Multi-turn", 187, 32,
     "User: Hi! I am planning a trip to Paris next spring and I would like some advice.\n"
     "Assistant: Happy to help. How long will you stay, and what do you enjoy most: museums, food, "
     "walking, or day trips outside the city?\n"
     "User: Five days. I love museums and good food, but I do not like crowded places very much.\n"
     "Assistant: Then visit the Louvre early on a weekday morning, or try the Musee d'Orsay and the "
     "Orangerie, which are calmer. For food, explore the markets of the 11th district and book a "
     "small bistro for dinner.\n"
     "User: That sounds great. What about getting around? Should I rent a car or use the metro?\n"
     "Assistant: Use the metro and walk; parking is hard and traffic is slow. A weekly pass is cheap.\n"
     "User: Perfect. Could you now suggest a day-by-day plan for the five days, with one day trip?\n"
     "Assistant:"),
    ("Code generation", 10, 48, "Write a Python function that returns the n-th Fibonacci number."),
    ("Long generation", 8, 48, "Tell me a long story about a dragon."),
    ("Essay", 6, 64, "Write an essay about computing."),
)

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "memory block cache engine token model batch paging request server latency stream queue kernel graph "
    "good new first last long great little own other old right big high different small large next early "
    "young important few public bad same able quick brown lazy red blue green open close fast slow"
).split()


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                    vocab: Vocab | None = None) -> list[BenchRequest]:
    """Seeded random lengths, uniform in [len*(1-ratio), len*(1+ratio)]; token-id prompts when vocab is given."""
    if not 0 <= range_ratio < 1:
        raise InvalidRequestError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise InvalidRequestError("num_prompts, input_len and output_len must be >= 1")
    rng = random.Random(seed)
    allowed = [t for t in range(vocab.size) if t not in vocab.special_ids] if vocab is not None else []
    out = []
    for i in range(num_prompts):
        n_in, n_out = _lengths(rng, input_len, range_ratio), _lengths(rng, output_len, range_ratio)
        prompt: str | list[int] = [rng.choice(allowed) for _ in range(n_in)] if vocab else random_words(rng, n_in)
        out.append(BenchRequest(prompt, n_out, True, f"random-{i}"))
    return out


def seed10_workload(num_prompts: int | None = None) -> list[BenchRequest]:
    """The seed's 10 requests (repeated in order when num_prompts > 10)."""
    n = len(SEED10) if num_prompts is None else num_prompts
    return [BenchRequest(SEED10[i % len(SEED10)][3], SEED10[i % len(SEED10)][2], True, SEED10[i % len(SEED10)][0])
            for i in range(n)]


def shared_prefix_workload(num_prompts: int, prefix_len: int = 256, suffix_len: int = 16, output_len: int = 16,
                           seed: int = 0) -> list[BenchRequest]:
    """One long system prompt (prefix_len words) shared by every request, then a distinct question."""
    rng = random.Random(seed)
    system = "System: you are a helpful assistant. Context: " + random_words(rng, prefix_len) + "\n"
    return [BenchRequest(f"{system}Question {i}: {random_words(rng, suffix_len)}?\nAnswer:", output_len, True,
                         f"shared-prefix-{i}") for i in range(num_prompts)]


def jsonl_workload(path: str | Path, num_prompts: int | None = None) -> list[BenchRequest]:
    """One {"prompt": ..., "max_tokens": ...} object per line (blank lines skipped)."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{lineno}: not JSON: {exc}") from None
        prompt, max_tokens = (obj.get("prompt"), obj.get("max_tokens", 16)) if isinstance(obj, dict) else (None, None)
        ok_prompt = isinstance(prompt, str) and prompt or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if not ok_prompt or not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidRequestError(f"{path}:{lineno}: expected {{\"prompt\": str or token ids, \"max_tokens\": int >= 1}}")
        ignore_eos = obj.get("ignore_eos", True)
        out.append(BenchRequest(prompt, max_tokens, bool(ignore_eos), f"line-{lineno}"))
        if num_prompts is not None and len(out) == num_prompts:
            break
    if not out:
        raise InvalidRequestError(f"{path}: no requests in the file")
    return out


WORKLOADS = ("random", "seed10", "shared-prefix")


def load_workload(name: str, *, num_prompts: int | None = None, input_len: int = 128, output_len: int = 32,
                  range_ratio: float = 0.0, prefix_len: int = 256, seed: int = 0,
                  vocab: Vocab | None = None) -> list[BenchRequest]:
    """A workload by name (random, seed10, shared-prefix) or a path to a JSONL file."""
    if name == "random":
        return random_workload(num_prompts or 100, input_len, output_len, range_ratio, seed, vocab)
    if name == "seed10":
        return seed10_workload(num_prompts)
    if name == "shared-prefix":
        return shared_prefix_workload(num_prompts or 32, prefix_len, 16, output_len, seed)
    if Path(name).is_file():
        return jsonl_workload(name, num_prompts)
    raise InvalidRequestError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)} or a JSONL file path")


def total_output_tokens(requests: Iterable[BenchRequest]) -> int:
    """Tokens the workload will generate when every request runs to max_tokens (ignore_eos)."""
    return sum(r.max_tokens for r in requests)
