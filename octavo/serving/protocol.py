"""Request bodies of /v1/completions and /v1/chat/completions -> validated requests with SamplingParams.

Every field is type-checked here, so a malformed body becomes a 400 that names the parameter
(never a 500 from deep inside the engine). A field we know but do not implement is a 400 when it asks for
anything but its default (REFUSED_EXTENSIONS, _REFUSED_CHAT), never silently ignored; an unknown field is
logged once per server (as vLLM does) and ignored. The body's typed getters: serving/body.py; a chat's
messages and rendering options: serving/chat_messages.py; output constraints: serving/constraints.py; tools:
serving/tools.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from octavo.errors import InvalidRequestError
from octavo.runtime.sampling_params import SamplingParams
from octavo.serving.api_error import ApiError, bad_request
from octavo.serving.body import Body, listed, show
from octavo.serving.chat_messages import ChatOptions, chat_options, parse_messages
from octavo.serving.constraints import CONSTRAINT_FIELDS, parse_constraint
from octavo.serving.token_fields import (Truncation, allowed_token_ids, logprob_token_ids, out_of_vocabulary, top_k,
                                         truncation)
from octavo.serving.tool_parser_registry import KEEPS_SPECIAL_TOKENS, TOOL_CALL_PARSERS
from octavo.serving.tools import ToolChoice, constraint, parse_tool_choice, parse_tools
from octavo.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # default top-k logprobs per token (OpenAI allows 5 / 20, vLLM 20): --max-logprobs sets Limits
_INT64 = 2**63
# vLLM request fields this server does not implement: given with a value other than their default, they are a 400
# (silently ignoring them would change what the client gets); name -> the value that means "off"
REFUSED_EXTENSIONS: dict[str, Any] = {
    "bad_words": [], "logits_processors": None,
    "prompt_embeds": None, "spaces_between_special_tokens": True, "documents": None, "mm_processor_kwargs": None,
    "kv_transfer_params": None, "cache_salt": None, "vllm_xargs": None,
    # vLLM sampling fields newer than the above: each would change the output if ignored
    "prompt_logprob_token_ids": None, "prompt_logprob_start": None, "repetition_detection": None,
    "trace_decode_token_ids": None, "watermarking": False, "ec_transfer_params": None,
}
# OpenAI chat fields this server does not implement (the deprecated functions API, audio, predicted outputs)
_REFUSED_CHAT: dict[str, Any] = {"functions": None, "function_call": None, "audio": None, "prediction": None,
                                 "web_search_options": None}
# every field the parsers read (anything else is unknown: logged once, ignored)
_COMMON_FIELDS = frozenset({
    "model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "max_tokens", "min_tokens", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "stream", "stream_options", "user",
    "return_token_ids", "return_tokens_as_token_ids", "include_metrics", "priority", "prompt_logprobs",
    "use_beam_search", "length_penalty", "echo", "add_special_tokens", "allowed_token_ids", "logprob_token_ids",
    "truncate_prompt_tokens", "truncation_side", *REFUSED_EXTENSIONS, *CONSTRAINT_FIELDS,
    "store", "metadata", "service_tier"})  # (the last three change nothing in the output)
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "suffix", "logprobs"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "include_reasoning",
    *_REFUSED_CHAT}


@dataclass(slots=True)
class Limits:
    """Server-side bounds applied while parsing."""

    vocab_size: int
    max_tokens_cap: int | None = None  # explicit max_tokens above this -> 400; unset max_tokens -> this
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_choices: int = 256  # prompts x n in one request
    tool_call_parser: str | None = None  # --tool-call-parser: what tool_choice "auto" reads calls with
    max_model_len: int | None = None  # the context (truncate_prompt_tokens' bound)
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs (resolved: -1 is the vocabulary size)
    warned_fields: set[str] = field(default_factory=set)  # unknown request fields already logged


@dataclass(slots=True)
class OutputOptions:
    """vLLM's extensions of what a response carries (shared by completions and chat)."""

    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    return_token_ids: bool = False  # prompt_token_ids and per-choice token_ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    include_metrics: bool = False  # per-request timing ("metrics"), also on with --enable-per-request-metrics
    priority: int = 0  # lower is scheduled first


@dataclass(slots=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top-k per token, None = off
    options: OutputOptions = field(default_factory=OutputOptions)
    prompt_logprobs: int | None = None  # vLLM's field: top-k per prompt token, returned as choices[].prompt_logprobs
    score_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) only, nothing generated
    constraint_where: str | None = None  # the request field the output constraint came from (for its errors)
    truncation: Truncation | None = None  # truncate_prompt_tokens / truncation_side


@dataclass(slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    options: OutputOptions = field(default_factory=OutputOptions)
    chat: ChatOptions = field(default_factory=ChatOptions)
    tools: list[dict[str, Any]] | None = None  # as the chat template receives them
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    constraint_where: str | None = None  # the request field the output constraint came from (for its errors)
    truncation: Truncation | None = None  # truncate_prompt_tokens / truncation_side
    prompt_logprobs: int | None = None  # vLLM's: top-k per token of the templated prompt, in "prompt_logprobs"
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out (with --reasoning-parser)


# ---------------------------------------------------------------------------------------------------
# shared sampling fields


def _stop(b: Body) -> list[str]:
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


def _logit_bias(b: Body, vocab_size: int) -> dict[int, float] | None:
    """token id -> bias in [-100, 100]. A 400 names every offending key and value, not only the first."""
    v = b.d.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    not_ids, outside, bad_values = [], [], []
    for key, bias in v.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            not_ids.append(key)
            continue
        if not 0 <= tok < vocab_size:
            outside.append(tok)
        elif not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
            bad_values.append(f"{key}: {show(bias)}")
        else:
            out[tok] = float(bias)
    problems = []
    if not_ids:
        problems.append(f"keys must be token ids (integers written as strings), not {listed(not_ids)}")
    if outside:
        problems.append(_out_of_vocabulary(outside, vocab_size))
    if bad_values:
        problems.append(f"biases must be numbers between -100 and 100, not {listed(bad_values, quote=False)}")
    if problems:
        raise bad_request("'logit_bias': " + "; ".join(problems), "logit_bias")
    return out


_out_of_vocabulary = out_of_vocabulary  # "... out of vocabulary (vocabulary size N; allowed: 0 to N-1)"


def _max_tokens(b: Body, names: tuple[str, ...], default: int | None, limits: Limits) -> int | None:
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


def _stream(b: Body) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats). continuous_usage_stats alone implies include_usage, as
    in vLLM (whose include_usage defaults to true inside stream_options); an explicit include_usage false wins."""
    stream = b.boolean("stream", False)
    opts = b.d.get("stream_options")
    if opts is None:
        return stream, False, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    flags = {}
    for key in ("include_usage", "continuous_usage_stats"):
        value = opts.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'stream_options.{key}' must be a boolean, got {show(value)}", "stream_options")
        flags[key] = value
    continuous = bool(flags["continuous_usage_stats"])
    include = flags["include_usage"] if flags["include_usage"] is not None else continuous
    return stream, include, continuous and include


def _output_options(b: Body, continuous: bool, logprobs_on: bool) -> OutputOptions:
    for name, off in REFUSED_EXTENSIONS.items():
        if name in b.d and b.d[name] is not None and b.d[name] != off:
            raise bad_request(f"'{name}' is not supported by this server (leave it unset)", name)
    as_ids = b.boolean("return_tokens_as_token_ids", False)
    return OutputOptions(
        continuous_usage=continuous,
        return_token_ids=b.boolean("return_token_ids", False),
        tokens_as_ids=as_ids and logprobs_on,
        include_metrics=b.boolean("include_metrics", False),
        priority=b.integer("priority", 0, lo=-_INT64, hi=_INT64 - 1) or 0,
    )


def _prompt_logprobs(b: Body, limits: Limits) -> int | None:
    """vLLM's prompt_logprobs: top-k logprobs of every prompt token (None: not asked; -1: the vocabulary)."""
    return top_k(b, "prompt_logprobs", limits.max_logprobs, limits.vocab_size, "prompt")


def _beam(b: Body, n: int) -> bool:
    """use_beam_search (vLLM's): beam width max(n, best_of), the n best returned, ranked by cumulative logprob /
    length ** length_penalty. The fields beam search does not use are refused, not ignored."""
    if not b.boolean("use_beam_search", False):
        if b.present("length_penalty") and b.number("length_penalty", 1.0) != 1.0:
            raise bad_request("'length_penalty' only applies with 'use_beam_search': true", "length_penalty")
        return False
    best_of = b.integer("best_of", None, lo=1)
    if best_of is not None and best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n}): it is the beam width", "best_of")
    # sampling knobs (temperature, top_p, top_k, min_p, seed) do not change a beam search: ignored, as vLLM does;
    # these would change what the client gets, so they are refused rather than ignored
    for name in ("stop", "stop_token_ids", "logprobs", "top_logprobs", "prompt_logprobs"):
        v = b.d.get(name)
        if v not in (None, False, [], ""):
            raise bad_request(f"'{name}' is not supported with beam search (hypotheses end at EOS or max_tokens "
                              "and carry no logprobs); leave it unset", name)
    return True


def _check_fields(b: Body, known: frozenset[str], limits: Limits, refused: dict[str, Any] | None = None) -> None:
    """400 for a known-but-unimplemented field that asks for something; log each unknown field once."""
    for name, off in (refused or {}).items():
        if b.d.get(name) is not None and b.d[name] != off:
            raise bad_request(f"'{name}' is not supported by this server (leave it unset)", name,
                              "unsupported_parameter")
    for name in b.d:
        if name not in known and name not in limits.warned_fields:
            limits.warned_fields.add(name)
            log.warning("ignoring unknown request field %r (logged once)", name[:80])


def _sampling(b: Body, limits: Limits, max_tokens: int | None, logprobs: int | None,
              structured: StructuredOutputsParams | None = None,
              logprob_ids: list[int] | None = None) -> SamplingParams:
    """SamplingParams of the shared fields. LOGPROB_IDS (vLLM's logprob_token_ids) replace the top-k: logprobs is
    then their number, whatever count the request gave (as vLLM)."""
    n = b.integer("n", 1, lo=1, hi=limits.max_n)
    best_of = b.integer("best_of", None, lo=1, hi=limits.max_n)
    beam = _beam(b, n)
    if best_of is not None and best_of != n and not beam:
        raise bad_request(f"'best_of' ({best_of}) different from 'n' ({n}) is only supported with "
                          "'use_beam_search': true (as the beam width)", "best_of",
                          "unsupported_parameter")
    b.string("user", None)  # accepted and type-checked, not used
    min_tokens = b.integer("min_tokens", 0, lo=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    stop_token_ids = b.int_list("stop_token_ids")
    outside = [t for t in stop_token_ids if not 0 <= t < limits.vocab_size]
    if outside:
        raise bad_request(f"'stop_token_ids': {_out_of_vocabulary(outside, limits.vocab_size)}", "stop_token_ids")
    top_k = b.integer("top_k", 0, lo=-1)
    seed = b.integer("seed", None)
    if seed is not None and not -_INT64 <= seed <= 2 * _INT64 - 1:
        raise bad_request(f"'seed' must be an integer between -2^63 and 2^64-1 (a 64-bit seed), got {seed}", "seed")
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
            logprobs=len(logprob_ids) if logprob_ids else logprobs,
            logprob_token_ids=logprob_ids,
            allowed_token_ids=allowed_token_ids(b, limits.vocab_size),
            skip_special_tokens=b.boolean("skip_special_tokens", True),
            structured_outputs=structured,
            use_beam_search=beam, best_of=best_of if beam else None,
            length_penalty=b.number("length_penalty", 1.0),
        )
    except InvalidRequestError as exc:  # the shared validator caught something our getters let through
        raise bad_request(str(exc)) from None


def _model(b: Body) -> str | None:
    return b.string("model", None)


# ---------------------------------------------------------------------------------------------------
# /v1/completions


def _prompts(b: Body, limits: Limits) -> list[str | list[int]]:
    p = b.d.get("prompt")
    msg = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if p is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
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
        outside = [t for t in q if not 0 <= t < limits.vocab_size] if isinstance(q, list) else []
        if outside:
            raise bad_request(f"prompt {_out_of_vocabulary(outside, limits.vocab_size)}", "prompt")
    return prompts


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    b = Body(body)
    _check_fields(b, _COMPLETION_FIELDS, limits)
    if b.present("suffix"):
        raise bad_request("'suffix' is not supported", "suffix", "unsupported_parameter")
    logprobs = top_k(b, "logprobs", limits.max_logprobs, limits.vocab_size, "sample")
    echo = b.boolean("echo", False)
    prompt_logprobs = _prompt_logprobs(b, limits)
    stream, include_usage, continuous = _stream(b)
    # echo with max_tokens 0 scores the prompt only (OpenAI's and vLLM's legacy use, lm-eval's loglikelihood):
    # the engine samples one token (its prefill yields the prompt's logprobs), the response drops it
    score_only = echo and b.integer("max_tokens", None, lo=0) == 0
    if score_only and b.integer("min_tokens", 0, lo=0):
        raise bad_request("'min_tokens' must be 0 when 'max_tokens' is 0 (echo: score the prompt only)", "min_tokens")
    max_tokens = 1 if score_only else _max_tokens(b, ("max_tokens",), 16, limits)
    prompts = _prompts(b, limits)
    structured, source = parse_constraint(b.d)
    if score_only and b.d.get("logprob_token_ids") is not None:
        raise bad_request("'logprob_token_ids' is not supported when 'echo' is true and 'max_tokens' is 0 (no "
                          "output tokens are generated)", "logprob_token_ids")
    ids = logprob_token_ids(b, limits.vocab_size, logprobs is not None, b.boolean("use_beam_search", False),
                            "'logprobs' must be set")
    params = _sampling(b, limits, max_tokens, logprobs, structured, ids)
    # the prompt's logprobs: asked for directly (vLLM), or echoed with logprobs (OpenAI's legacy shape)
    wanted = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    if wanted:
        params.prompt_logprobs = max(wanted)
        params.validate()
    if len(prompts) * params.n > limits.max_choices:
        raise bad_request(f"{len(prompts)} prompts x n={params.n} is more than {limits.max_choices} choices "
                          "in one request", "n")
    return CompletionRequest(
        model=_model(b), prompts=prompts, params=params,
        stream=stream, include_usage=include_usage, echo=echo, logprobs=logprobs,
        options=_output_options(b, continuous, logprobs is not None),
        prompt_logprobs=prompt_logprobs, score_only=score_only, constraint_where=source,
        truncation=truncation(b, limits.max_model_len, max_tokens),
    )


# ---------------------------------------------------------------------------------------------------
# /v1/chat/completions


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
    b = Body(body)
    _check_fields(b, _CHAT_FIELDS, limits, _REFUSED_CHAT)
    structured, source = parse_constraint(b.d)
    tools = parse_tools(b.d)
    choice = parse_tool_choice(b.d, tools)
    parallel = b.boolean("parallel_tool_calls", True)
    if choice.mode == "auto" and tools and limits.tool_call_parser is None:
        raise bad_request("tool_choice 'auto' needs a tool call parser: start the server with --tool-call-parser "
                          f"({', '.join(TOOL_CALL_PARSERS)}), or send tool_choice 'required', 'none' or a named "
                          "function",
                          "tool_choice")
    forced, forced_where = constraint(tools, choice, parallel)
    if forced is not None and structured is not None:
        raise bad_request(f"'{source}' cannot be combined with tool_choice {choice.mode!r} (which constrains the "
                          "output to the tool call)", source)
    logprobs = b.boolean("logprobs", False)
    top = top_k(b, "top_logprobs", limits.max_logprobs, limits.vocab_size, "sample")
    if top and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    top = top or 0
    stream, include_usage, continuous = _stream(b)
    max_tokens = _max_tokens(b, ("max_completion_tokens", "max_tokens"), None, limits)
    messages = parse_messages(b)
    ids = logprob_token_ids(b, limits.vocab_size, logprobs, b.boolean("use_beam_search", False),
                            "'logprobs' must be set to true")
    params = _sampling(b, limits, max_tokens, top if logprobs else None, forced or structured, ids)
    if tools and choice.mode == "auto" and limits.tool_call_parser in KEEPS_SPECIAL_TOKENS:
        params.skip_special_tokens = False  # the parser reads its markers, which are special tokens (vLLM too)
    prompt_logprobs = _prompt_logprobs(b, limits)
    if prompt_logprobs and stream:  # vLLM's rule (0 with a stream is accepted, and nothing is returned)
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    if prompt_logprobs is not None and not stream:
        params.prompt_logprobs = prompt_logprobs
        params.validate()
    return ChatRequest(
        model=_model(b), messages=messages, params=params,
        stream=stream, include_usage=include_usage, logprobs=logprobs, top_logprobs=top,
        options=_output_options(b, continuous, logprobs), chat=chat_options(b, messages),
        tools=tools, tool_choice=choice, parallel_tool_calls=parallel, constraint_where=forced_where or source,
        truncation=truncation(b, limits.max_model_len, max_tokens),
        prompt_logprobs=prompt_logprobs if not stream else None,
        include_reasoning=b.boolean("include_reasoning", True),
    )


def check_model(requested: str | None, served: tuple[str, ...]) -> None:
    """404 when the request names a model this server does not serve (absent model = the served one)."""
    if requested is not None and requested not in served:
        raise ApiError(404, f"The model `{requested}` does not exist; this server serves "
                            f"{', '.join(repr(s) for s in served)}", param="model", code="model_not_found")
