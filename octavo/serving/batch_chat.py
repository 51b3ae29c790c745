"""The body of vLLM's POST /v1/chat/completions/batch: `messages` is a list of conversations, the other fields
those of a chat completion, shared by all of them. As vLLM: no stream, no tools, no beam search, n = 1 (one
choice per conversation); beyond vLLM, fields that would not mean one thing per conversation (prompt_logprobs,
whose response field is one list) are refused rather than ignored. Bounded: at most Limits.max_prompts
conversations (the body as a whole is within --max-body-bytes like every body).
"""
from __future__ import annotations

from typing import Any

from octavo.serving.api_error import ApiError, bad_request
from octavo.serving.body import Body, show
from octavo.serving.protocol import ChatRequest, Limits, parse_chat

# field -> what it must be in a batch (vLLM's check_batch_mode, and prompt_logprobs: see the docstring)
_REFUSED = {
    "stream": ("must be false or absent (batch chat completions are not streamed)", (None, False)),
    "stream_options": ("is only for streams, and a batch is not streamed", (None,)),
    "tools": ("is not supported by batch chat completions (send each conversation to /v1/chat/completions)",
              (None,)),
    "tool_choice": ("must be 'none' or absent (batch chat completions take no tools)", (None, "none")),
    "use_beam_search": ("is not supported by batch chat completions", (None, False)),
    "n": ("must be 1: batch chat completions give one choice per conversation", (None, 1)),
    "prompt_logprobs": ("is not supported by batch chat completions (the response has one prompt_logprobs list); "
                        "send each conversation to /v1/chat/completions", (None,)),
}


def parse_batch_chat(body: Any, limits: Limits) -> tuple[ChatRequest, list[list[dict[str, Any]]]]:
    """The shared request (parsed with the first conversation) and every conversation, each checked as the
    messages of a chat completion with the same fields (so a 400 names what is wrong where)."""
    b = Body(body)
    for name, (why, allowed) in _REFUSED.items():
        v = b.d.get(name)
        if any(v is a or (v == a and type(v) is type(a)) for a in allowed):
            continue
        raise bad_request(f"'{name}' {why}, got {show(v)}", name,
                          "invalid_value" if name in ("n", "stream") else "unsupported_parameter")
    convs = b.d.get("messages")
    if convs is None:
        raise bad_request("'messages' is required: a list of conversations (each a list of messages)", "messages",
                          "missing_required_parameter")
    if not isinstance(convs, list) or not convs or any(not isinstance(c, list) or not c for c in convs):
        raise bad_request("'messages' must be a non-empty list of conversations, each a non-empty list of messages",
                          "messages")
    if len(convs) > limits.max_prompts:
        raise bad_request(f"at most {limits.max_prompts} conversations per batch, got {len(convs)}", "messages")
    parsed: list[ChatRequest] = []
    for i, conv in enumerate(convs):
        try:
            parsed.append(parse_chat({**b.d, "messages": conv}, limits))
        except ApiError as exc:
            if exc.param == "messages":  # say which conversation
                raise bad_request(f"conversation {i}: {exc.message}", "messages") from None
            raise
    return parsed[0], [p.messages for p in parsed]


__all__ = ["parse_batch_chat"]
