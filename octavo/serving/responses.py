"""Response bodies in OpenAI's exact JSON shapes (completions, chat completions, their SSE chunks, usage,
logprobs, models). Pure functions over plain values: no HTTP, no engine."""
from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from octavo.runtime.outputs import Logprob

Decode = Callable[[int], str]
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def new_id(prefix: str) -> str:
    """'cmpl-…' / 'chatcmpl-…': OpenAI-style ids, 128 random bits."""
    return f"{prefix}-{secrets.token_hex(16)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_id_text(token_id: int) -> str:
    """A logprob token written as its id (vLLM's return_tokens_as_token_ids): always valid JSON text."""
    return f"token_id:{token_id}"


def request_metrics(arrival: float | None, scheduled: float | None, first_token: float | None,
                    last_token: float | None, num_tokens: int) -> dict[str, float | None]:
    """vLLM's per-request "metrics" (milliseconds, engine clock): queue = arrival -> first scheduled; time to
    first token = scheduled -> first token; generation (decode) = first -> last token; mean inter-token
    latency = generation / (tokens - 1); tokens per second = tokens / (scheduled -> last token)."""
    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(max(b - a, 0.0) * 1000.0, 3)

    gen = ms(first_token, last_token)
    busy = ms(scheduled, last_token)
    return {
        "time_to_first_token_ms": ms(scheduled, first_token),
        "generation_time_ms": gen,
        "queue_time_ms": ms(arrival, scheduled),
        "mean_itl_ms": round(gen / (num_tokens - 1), 3) if gen is not None and num_tokens > 1 else None,
        "tokens_per_second": round(num_tokens / (busy / 1000.0), 3) if busy else None,
    }


# ---------------------------------------------------------------------------------------------------
# /v1/completions


def completion(rid: str, created: int, model: str, choices: list[dict[str, Any]],
               use: dict[str, int] | None, *, chunk: bool = False, with_usage_field: bool = False) -> dict[str, Any]:
    """A text_completion object; as an SSE chunk, 'usage' is present only when stream_options asked for it."""
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": choices}
    if not chunk or with_usage_field:
        out["usage"] = use
    return out


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None,
                      prompt_logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:  # vLLM's field, present when the request asked for it
        out["prompt_logprobs"] = prompt_logprobs
    return out


def completion_logprobs(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], top_k: int | None,
                        decode: Decode, text_offset: int = 0, as_ids: bool = False) -> dict[str, Any]:
    """Legacy logprobs: tokens, token_logprobs, top_logprobs (top-k plus the chosen token), text_offset.
    as_ids: tokens written as "token_id:<id>" (text_offset still counts the decoded text). top_k None: every entry
    in the engine's order (vLLM's logprob_token_ids: the chosen token, then the asked ids)."""
    shown = _token_id_or_text(decode, as_ids)
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, entry in zip(token_ids, entries):
        tokens.append(shown(tid, entry))
        token_logprobs.append(_lp(entry[tid].logprob) if tid in entry else _MIN_LOGPROB)
        best: dict[str, float] = {}
        for t, lp in _top(entry, top_k, tid):  # tokens that read the same (byte pieces: "\ufffd") keep the likeliest
            best.setdefault(shown(t, entry), _lp(lp.logprob))
        top.append(best)
        offsets.append(text_offset)
        text_offset += len(_token_text(tid, entry, decode))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def text_length(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], decode: Decode) -> int:
    """Characters of these tokens' text (where the next text_offset starts)."""
    return sum(len(_token_text(tid, entry, decode)) for tid, entry in zip(token_ids, entries))
def echo_logprobs(prompt_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], top_k: int,
                  decode: Decode, as_ids: bool = False) -> tuple[dict[str, Any], int]:
    """The prompt's part of legacy logprobs under echo: like completion_logprobs, but the first token has no
    context, so its token_logprobs and top_logprobs entries are null (OpenAI's and vLLM's shape). Returns it
    and the text_offset where the text after the prompt starts."""
    rest_entries = [e or {} for e in entries[1:]]
    if not prompt_ids:
        return completion_logprobs([], [], top_k, decode), 0
    first_entry = entries[0] or {}
    first_len = len(_token_text(prompt_ids[0], first_entry, decode))
    rest = completion_logprobs(rest_entries, prompt_ids[1:], top_k, decode, first_len, as_ids)
    head = {"tokens": [_token_id_or_text(decode, as_ids)(prompt_ids[0], first_entry), *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]], "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}
    return head, first_len + text_length(rest_entries, prompt_ids[1:], decode)


def joined_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects back to back (the echoed prompt's, then the generated tokens')."""
    return {k: [*head[k], *tail[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprobs_json(prompt_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
                         top_k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt position null (the first) or {token id: {logprob, rank, decoded_token}}
    holding the TOP_K most likely tokens there and the prompt's own token."""
    return [None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded}
                                    for t, lp in _top(e, top_k, tid)} for tid, e in zip(prompt_ids, entries)]


# ---------------------------------------------------------------------------------------------------
# /v1/chat/completions


def chat(rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, int] | None,
         *, chunk: bool = False, with_usage_field: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
                           "created": created, "model": model, "choices": choices}
    if not chunk or with_usage_field:
        out["usage"] = use
    return out


def chat_choice(index: int, content: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": content, "refusal": None, "reasoning": None},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if "reasoning" not in delta:  # vLLM always sends the key (null when the model does not reason)
        delta = {**delta, "reasoning": None}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_logprobs(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], top_k: int | None,
                  decode: Decode, as_ids: bool = False) -> dict[str, Any]:
    """Chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
    as_ids: tokens written as "token_id:<id>"; bytes stay those of the token's text. top_k None: every entry in
    the engine's order (logprob_token_ids)."""
    shown = _token_id_or_text(decode, as_ids)
    content = []
    for tid, entry in zip(token_ids, entries):
        content.append({
            "token": shown(tid, entry), "logprob": _lp(entry[tid].logprob) if tid in entry else _MIN_LOGPROB,
            "bytes": list(_token_text(tid, entry, decode).encode("utf-8", errors="replace")),
            "top_logprobs": [
                {"token": shown(k, entry), "logprob": _lp(lp.logprob),
                 "bytes": list(_token_text(k, entry, decode).encode("utf-8", errors="replace"))}
                for k, lp in _top(entry, top_k, None)
            ],
        })
    return {"content": content}


# ---------------------------------------------------------------------------------------------------
# /v1/models


def model_list(names: Sequence[str], created: int, max_model_len: int | None) -> dict[str, Any]:
    return {"object": "list", "data": [
        # root / parent as vLLM's cards (routers' service discovery reads them): every name serves the base model
        {"id": n, "object": "model", "created": created, "owned_by": "octavo", "root": names[0], "parent": None,
         "max_model_len": max_model_len}
        for n in names]}


# ---------------------------------------------------------------------------------------------------


def _lp(x: float) -> float:
    return float(x) if math.isfinite(x) else _MIN_LOGPROB


def _token_id_or_text(decode: Decode, as_ids: bool) -> Callable[[int, dict[int, Logprob]], str]:
    if as_ids:
        return lambda tid, entry: token_id_text(tid)
    return lambda tid, entry: _token_text(tid, entry, decode)


def _token_text(tid: int, entry: dict[int, Logprob], decode: Decode) -> str:
    lp = entry.get(tid)
    return lp.decoded if lp is not None and lp.decoded else decode(tid)


def _top(entry: dict[int, Logprob], k: int | None, chosen: int | None) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position; the chosen token is added when it is not among them. K None:
    every entry, in the engine's order."""
    if k is None:
        return list(entry.items())
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
    if chosen is not None and chosen in entry and all(t != chosen for t, _ in ranked):
        ranked.append((chosen, entry[chosen]))
    return ranked
