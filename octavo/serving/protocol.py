"""Request bodies of /v1/completions and /v1/chat/completions -> validated requests with SamplingParams.

Every field is type-checked here, so a malformed body becomes a 400 that names the parameter
(never a 500 from deep inside the engine). Unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from octavo.errors import InvalidRequestError
from octavo.runtime.sampling_params import SamplingParams
from octavo.serving.api_error import ApiError, bad_request

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # top-k logprobs per token (OpenAI allows 5 / 20, vLLM 20)
_INT64 = 2**63
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class Limits:
    """Server-side bounds applied while parsing."""

    vocab_size: int
    max_tokens_cap: int | None = None  # explicit max_tokens above this -> 400; unset max_tokens -> this
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_choices: int = 256  # prompts x n in one request


@dataclass(slots=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top-k per token, None = off


@dataclass(slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int


class _Body:
    """Typed getters over a JSON object; each raises a 400 naming the parameter."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.d: dict[str, Any] = body

    def present(self, name: str) -> bool:
        return self.d.get(name) is not None

    def boolean(self, name: str, default: bool) -> bool:
        v = self.d.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must be a boolean, got {_show(v)}", name)
        return v

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.d.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad_request(f"'{name}' must be an integer, got {_show(v)}", name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad_request(f"'{name}' must be in [{_bound(lo)}, {_bound(hi)}], got {v}", name)
        return v

    def number(self, name: str, default: float, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float:
        v = self.d.get(name)
        if v is None:
            return default
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise bad_request(f"'{name}' must be a finite number, got {_show(v)}", name)
        if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            left = "(" if lo_open else "["
            raise bad_request(f"'{name}' must be in {left}{_bound(lo)}, {_bound(hi)}], got {v}", name)
        return float(v)

    def string(self, name: str, default: str | None) -> str | None:
        v = self.d.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad_request(f"'{name}' must be a string, got {_show(v)}", name)
        return v

    def int_list(self, name: str) -> list[int]:
        v = self.d.get(name)
        if v is None:
            return []
        if not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) for x in v):
            raise bad_request(f"'{name}' must be a list of integers", name)
        return v


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _bound(b: float | None) -> str:
    return "inf" if b is None else str(b)


# ---------------------------------------------------------------------------------------------------
# shared sampling fields


def _stop(b: _Body) -> list[str]:
    v = b.d.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(v) > 16:
        raise bad_request(f"'stop' may hold at most 16 strings, got {len(v)}", "stop")
    return v


def _logit_bias(b: _Body, vocab_size: int) -> dict[int, float] | None:
    v = b.d.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' keys must be token ids, got {_show(key)}", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise bad_request(f"'logit_bias' token id {tok} is outside the vocabulary [0, {vocab_size})",
                              "logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {_show(bias)}",
                              "logit_bias")
        out[tok] = float(bias)
    return out


def _max_tokens(b: _Body, names: tuple[str, ...], default: int | None, limits: Limits) -> int | None:
    value: int | None = None
    for name in names:  # first present wins (chat: max_completion_tokens over the deprecated max_tokens)
        value = b.integer(name, None, lo=1)
        if value is not None:
            if limits.max_tokens_cap is not None and value > limits.max_tokens_cap:
                raise bad_request(f"'{name}' is {value}, above this server's cap of {limits.max_tokens_cap} "
                                  "(--max-tokens-cap)", name)
            return value
    if default is not None:
        return default if limits.max_tokens_cap is None else min(default, limits.max_tokens_cap)
    return limits.max_tokens_cap


def _stream(b: _Body) -> tuple[bool, bool]:
    stream = b.boolean("stream", False)
    opts = b.d.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    inc = opts.get("include_usage", False)
    if not isinstance(inc, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, inc


def _sampling(b: _Body, limits: Limits, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    n = b.integer("n", 1, lo=1, hi=limits.max_n)
    best_of = b.integer("best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' different from 'n' is not supported", "best_of")
    b.string("user", None)  # accepted and type-checked, not used
    min_tokens = b.integer("min_tokens", 0, lo=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    stop_token_ids = b.int_list("stop_token_ids")
    if any(not 0 <= t < limits.vocab_size for t in stop_token_ids):
        raise bad_request(f"'stop_token_ids' must be token ids in [0, {limits.vocab_size})", "stop_token_ids")
    top_k = b.integer("top_k", 0, lo=-1)
    seed = b.integer("seed", None, lo=-_INT64, hi=2 * _INT64 - 1)
    if seed is not None and seed < 0:
        seed %= 2 * _INT64  # an int64 seed as its unsigned 64-bit twin: RNGs want non-negative seeds
    try:
        return SamplingParams(
            n=n,
            temperature=b.number("temperature", 1.0, lo=0.0),
            top_p=b.number("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
            top_k=0 if top_k == -1 else top_k,
            min_p=b.number("min_p", 0.0, lo=0.0, hi=1.0),
            seed=seed,
            repetition_penalty=b.number("repetition_penalty", 1.0, lo=0.0, lo_open=True),
            presence_penalty=b.number("presence_penalty", 0.0, lo=-2.0, hi=2.0),
            frequency_penalty=b.number("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
            logit_bias=_logit_bias(b, limits.vocab_size),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop=_stop(b),
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=b.boolean("include_stop_str_in_output", False),
            ignore_eos=b.boolean("ignore_eos", False),
            logprobs=logprobs,
            skip_special_tokens=b.boolean("skip_special_tokens", True),
        )
    except InvalidRequestError as exc:  # the shared validator caught something our getters let through
        raise bad_request(str(exc)) from None


def _model(b: _Body) -> str | None:
    return b.string("model", None)


# ---------------------------------------------------------------------------------------------------
# /v1/completions


def _prompts(b: _Body, limits: Limits) -> list[str | list[int]]:
    p = b.d.get("prompt")
    msg = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if p is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        prompts = list(p)
    else:
        raise bad_request(msg if p != [] else "'prompt' must not be empty", "prompt")
    if len(prompts) > limits.max_prompts:
        raise bad_request(f"at most {limits.max_prompts} prompts per request, got {len(prompts)}", "prompt")
    for q in prompts:
        if isinstance(q, list) and any(not 0 <= t < limits.vocab_size for t in q):
            raise bad_request(f"prompt token ids must be in [0, {limits.vocab_size})", "prompt")
    return prompts


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    b = _Body(body)
    if b.present("suffix"):
        raise bad_request("'suffix' is not supported", "suffix")
    logprobs = b.integer("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    stream, include_usage = _stream(b)
    max_tokens = _max_tokens(b, ("max_tokens",), 16, limits)
    prompts = _prompts(b, limits)
    params = _sampling(b, limits, max_tokens, logprobs)
    if len(prompts) * params.n > limits.max_choices:
        raise bad_request(f"{len(prompts)} prompts x n={params.n} is more than {limits.max_choices} choices "
                          "in one request", "n")
    return CompletionRequest(
        model=_model(b), prompts=prompts, params=params,
        stream=stream, include_usage=include_usage, echo=b.boolean("echo", False), logprobs=logprobs,
    )


# ---------------------------------------------------------------------------------------------------
# /v1/chat/completions


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                  "are supported", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(b: _Body) -> list[dict[str, str]]:
    msgs = b.d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {_show(role)}",
                              "messages")
        msg = {"role": role, "content": _content(m, i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
    b = _Body(body)
    for unsupported in ("tools", "functions"):
        if b.d.get(unsupported):
            raise bad_request(f"'{unsupported}' is not supported by this server", unsupported)
    rf = b.d.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    logprobs = b.boolean("logprobs", False)
    top = b.integer("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    top = top or 0
    stream, include_usage = _stream(b)
    max_tokens = _max_tokens(b, ("max_completion_tokens", "max_tokens"), None, limits)
    return ChatRequest(
        model=_model(b), messages=_messages(b),
        params=_sampling(b, limits, max_tokens, top if logprobs else None),
        stream=stream, include_usage=include_usage, logprobs=logprobs, top_logprobs=top,
    )


def check_model(requested: str | None, served: tuple[str, ...]) -> None:
    """404 when the request names a model this server does not serve (absent model = the served one)."""
    if requested is not None and requested not in served:
        raise ApiError(404, f"The model `{requested}` does not exist; this server serves "
                            f"{', '.join(repr(s) for s in served)}", param="model", code="model_not_found")
