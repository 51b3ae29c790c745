"""Token-id workloads that every peer can take as is (no tokenizer in the measured path).

- seed10:        the seed's 10-request mix: its prompt lengths (2 .. 507 tokens) and generation lengths
                 (4 .. 64) from octavo.bench.workloads.SEED10, prompts of random ids of those lengths.
- random64:      64 requests, prompt lengths uniform in 16..256, output lengths uniform in 16..128.
- shared-prefix: one long random prefix shared by every request, then a short distinct suffix, all sent
                 at once and cold (nothing cached before the timed run) to every peer.
Ids are drawn from the non-special part of the vocabulary, seeded: same seed, same workload everywhere.
Fixed output lengths: every peer generates exactly max_tokens tokens, ignoring EOS.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from octavo.bench.workloads import SEED10

FIRST_ID = 3  # ids 0..2 are <unk> <s> </s> in the perf tokenizer


@dataclass(slots=True)
class IdRequest:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class IdWorkload:
    name: str
    requests: list[IdRequest]
    note: str = ""
    shared_prefix_len: int = 0  # leading tokens every prompt shares

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    def to_dict(self) -> dict:
        return {"name": self.name, "note": self.note, "shared_prefix_len": self.shared_prefix_len,
                "requests": [{"prompt": r.prompt, "max_tokens": r.max_tokens} for r in self.requests]}

    @classmethod
    def from_dict(cls, d: dict) -> IdWorkload:
        return cls(d["name"], [IdRequest(list(r["prompt"]), int(r["max_tokens"])) for r in d["requests"]], d.get("note", ""),
                   int(d.get("shared_prefix_len", 0)))


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def seed10(vocab_size: int, seed: int = 0, scale: float = 1.0) -> IdWorkload:
    """The seed's mix; scale < 1 shrinks the lengths (quick runs), keeping at least one token each."""
    rng = random.Random(seed)
    reqs = [IdRequest(_ids(rng, max(1, round(p * scale)), vocab_size), max(1, round(g * scale)))
            for _, p, g, _ in SEED10]
    return IdWorkload("seed10", reqs, "the seed's 10-request mix (its prompt and generation lengths)")


def random_uniform(vocab_size: int, num: int = 64, prompt: tuple[int, int] = (16, 256),
                   output: tuple[int, int] = (16, 128), seed: int = 0) -> IdWorkload:
    rng = random.Random(seed)
    reqs = []
    for _ in range(num):
        n_in, n_out = rng.randint(*prompt), rng.randint(*output)
        reqs.append(IdRequest(_ids(rng, n_in, vocab_size), n_out))
    return IdWorkload(f"random{num}", reqs,
                      f"{num} requests, prompts uniform in {prompt[0]}..{prompt[1]}, outputs in {output[0]}..{output[1]}")


def shared_prefix(vocab_size: int, num: int = 32, prefix_len: int = 512, suffix_len: int = 16, output_len: int = 16,
                  seed: int = 0) -> IdWorkload:
    rng = random.Random(seed)
    prefix = _ids(rng, prefix_len, vocab_size)
    reqs = [IdRequest(prefix + _ids(rng, suffix_len, vocab_size), output_len) for _ in range(num)]
    return IdWorkload("shared-prefix", reqs,
                      f"{num} requests sharing a {prefix_len}-token prefix, {suffix_len}-token suffixes, {output_len} out",
                      prefix_len)


# -- the real model's workloads (issue 18): token-id prompts drawn from FIRST_ID and up of the real vocabulary

def batch(vocab_size: int, num: int = 48, prompt: tuple[int, int] = (32, 400), output: tuple[int, int] = (16, 160),
          seed: int = 0) -> IdWorkload:
    """NUM requests sent at once: throughput under load (output tok/s)."""
    w = random_uniform(vocab_size, num, prompt, output, seed)
    return IdWorkload(f"batch{num}", w.requests,
                      f"{num} requests at once, prompts {prompt[0]}-{prompt[1]}, outputs {output[0]}-{output[1]}: "
                      "output tok/s")


def single_decode(vocab_size: int, prompt_len: int = 64, output_len: int = 128, seed: int = 0) -> IdWorkload:
    """One request alone: single-user decode speed (decode tok/s, the first token left out)."""
    rng = random.Random(seed)
    return IdWorkload(f"decode{prompt_len}+{output_len}", [IdRequest(_ids(rng, prompt_len, vocab_size), output_len)],
                      f"one request, {prompt_len}-token prompt, {output_len} tokens: decode tok/s (first token left out)")


def long_prefill(vocab_size: int, prompt_len: int = 6000, output_len: int = 16, seed: int = 0) -> IdWorkload:
    """One long prompt, a few tokens out: prefill speed (seconds for the whole request)."""
    rng = random.Random(seed)
    return IdWorkload(f"prefill{prompt_len}", [IdRequest(_ids(rng, prompt_len, vocab_size), output_len)],
                      f"one {prompt_len}-token prompt, {output_len} tokens: seconds")
