"""vLLM's token-level request fields, parsed and bounded: `allowed_token_ids`, `logprob_token_ids`, the top-k
logprob counts (`logprobs`, `top_logprobs`, `prompt_logprobs`) against the server's --max-logprobs, and prompt
truncation (`truncate_prompt_tokens`, `truncation_side`).

Every list a client sends here is capped (allowed_token_ids by the vocabulary size, logprob_token_ids by vLLM's
128) and every id checked against the vocabulary; a 400 names the field, the offenders and the vocabulary size.
"""
from __future__ import annotations

from dataclasses import dataclass

from octavo.runtime.sampling_params import MAX_LOGPROB_TOKEN_IDS
from octavo.serving.api_error import bad_request
from octavo.serving.body import Body, listed, show

TRUNCATION_SIDES = ("left", "right")


@dataclass(slots=True, frozen=True)
class Truncation:
    """truncate_prompt_tokens (resolved: -1 is already the context minus max_tokens) and truncation_side."""

    tokens: int  # keep at most this many prompt tokens
    side: str = "left"  # "left": drop from the start, keep the last tokens (vLLM's default); "right": keep the first

    def apply(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.tokens:
            return ids
        return ids[-self.tokens:] if self.side == "left" else ids[:self.tokens]


def out_of_vocabulary(ids: list[int], vocab_size: int) -> str:
    several = len(ids) > 1
    return (f"token id{'s' if several else ''} {listed(ids)} {'are' if several else 'is'} out of vocabulary "
            f"(vocabulary size {vocab_size}; allowed: 0 to {vocab_size - 1})")


def token_ids(b: Body, name: str, vocab_size: int, cap: int) -> list[int] | None:
    """A non-empty list of at most CAP token ids of the vocabulary, or None when absent / null."""
    v = b.d.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in v):
        raise bad_request(f"'{name}' must be a list of token ids (integers), got {show(v)}", name)
    if not v:
        raise bad_request(f"'{name}' must not be an empty list", name)
    if len(v) > cap:
        raise bad_request(f"'{name}' holds {len(v)} token ids, more than the {cap} allowed", name)
    outside = [t for t in v if not 0 <= t < vocab_size]
    if outside:
        raise bad_request(f"'{name}': {out_of_vocabulary(outside, vocab_size)}", name)
    return v


def allowed_token_ids(b: Body, vocab_size: int) -> list[int] | None:
    return token_ids(b, "allowed_token_ids", vocab_size, vocab_size)


def logprob_token_ids(b: Body, vocab_size: int, logprobs_on: bool, beam: bool, need: str) -> list[int] | None:
    """vLLM's logprob_token_ids: needs logprobs (NEED says how they are turned on), not with beam search."""
    ids = token_ids(b, "logprob_token_ids", vocab_size, MAX_LOGPROB_TOKEN_IDS)
    if ids is None:
        return None
    if beam:
        raise bad_request("'logprob_token_ids' is not supported with beam search", "logprob_token_ids")
    if not logprobs_on:
        raise bad_request(f"when using 'logprob_token_ids', {need}", "logprob_token_ids")
    return ids


def top_k(b: Body, name: str, max_logprobs: int, vocab_size: int, what: str) -> int | None:
    """A top-k logprob count: 0..max_logprobs, or -1 for the whole vocabulary (vLLM), resolved to its size."""
    v = b.integer(name, None)
    if v is None:
        return None
    if v < -1:
        raise bad_request(f"'{name}' must be a positive value or -1 (the whole vocabulary), got {v}", name)
    k = vocab_size if v == -1 else v
    if k > max_logprobs:
        raise bad_request(f"'{name}' must be an integer between 0 and {max_logprobs}, got {v}: requested {what} "
                          f"logprobs of {k}, which is greater than max allowed: {max_logprobs} (the server's "
                          f"--max-logprobs; -1 there allows the whole vocabulary of {vocab_size} tokens)", name)
    return k


def truncation(b: Body, max_model_len: int | None, max_tokens: int | None) -> Truncation | None:
    """truncate_prompt_tokens / truncation_side as vLLM reads them: N keeps N prompt tokens (N at most the
    context minus max_tokens), -1 keeps as many as fit beside max_tokens; the side says which end is kept."""
    side = b.d.get("truncation_side")
    if side is not None and side not in TRUNCATION_SIDES:
        raise bad_request(f"'truncation_side' must be 'left' or 'right', got {show(side)}", "truncation_side")
    n = b.integer("truncate_prompt_tokens", None)
    if n is None:
        return None
    if n < -1 or n == 0:
        raise bad_request(f"'truncate_prompt_tokens' must be a positive number of tokens to keep, or -1 (as many "
                          f"as fit beside max_tokens), got {n}", "truncate_prompt_tokens")
    room = None if max_model_len is None else max_model_len - (max_tokens or 0)
    if n == -1:
        if room is None:
            return None
        n = min(room, max_model_len - 1) if max_model_len is not None else room
    elif room is not None and n > room:
        raise bad_request(f"'truncate_prompt_tokens' ({n}) cannot be greater than max_model_len ({max_model_len}) "
                          f"- max_tokens ({max_tokens or 0}) = {room}: request a smaller truncation size",
                          "truncate_prompt_tokens")
    if n < 1:
        raise bad_request(f"max_tokens ({max_tokens}) leaves no room for a prompt in the context of {max_model_len} "
                          "tokens", "max_tokens")
    return Truncation(n, side or "left")


__all__ = ["TRUNCATION_SIDES", "Truncation", "allowed_token_ids", "logprob_token_ids", "out_of_vocabulary", "top_k",
           "token_ids", "truncation"]
