"""The server's OpenAPI 3.0 description, served at GET /openapi.json (behind the API key like every route
but /health). It is written by hand from what octavo/serving/protocol.py accepts, with this server's
limits filled in (served model names, max_tokens cap, n cap), so a schema-driven fuzzer
(schemathesis) can generate valid and invalid requests and check every answer against it.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from octavo.runtime.sampling_params import MAX_LOGPROB_TOKEN_IDS
from octavo.serving.openapi_apis import api_paths, api_schemas
from octavo.serving.protocol import MAX_LOGPROBS

OPENAPI_PATH = "/openapi.json"
_JSON = "application/json"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _int(lo: int | None = None, hi: int | None = None, **kw: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer", **kw}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _num(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "number", "nullable": True}
    if lo is not None:
        s["minimum"] = lo
        if lo_open:
            s["exclusiveMinimum"] = True
    if hi is not None:
        s["maximum"] = hi
    return s


def _sampling(max_tokens_cap: int | None, max_n: int, vocab_size: int | None) -> dict[str, Any]:
    """Fields shared by completions and chat completions."""
    token = _int(0, vocab_size - 1 if vocab_size else None)
    return {
        "model": {"type": "string", "nullable": True, "description": "absent = the served model"},
        "n": _int(1, max_n, nullable=True),
        "best_of": _int(1, max_n, nullable=True, description="must equal n, except as the beam width"),
        "temperature": _num(0.0),
        "top_p": _num(0.0, 1.0, lo_open=True),
        "top_k": _int(-1, nullable=True, description="-1 or 0: off"),
        "min_p": _num(0.0, 1.0),
        "seed": _int(-(2**63), 2**64 - 1, nullable=True),
        "repetition_penalty": _num(0.0, lo_open=True),
        "presence_penalty": _num(-2.0, 2.0),
        "frequency_penalty": _num(-2.0, 2.0),
        "logit_bias": {"type": "object", "nullable": True, "additionalProperties": _num(-100.0, 100.0),
                       "description": "token id (as a string) -> bias"},
        "max_tokens": _int(1, max_tokens_cap, nullable=True),
        "min_tokens": _int(0, max_tokens_cap, nullable=True),
        "stop": {"nullable": True, "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}}]},
        "stop_token_ids": {"type": "array", "nullable": True, "items": token},
        "include_stop_str_in_output": {"type": "boolean", "nullable": True},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "skip_special_tokens": {"type": "boolean", "nullable": True},
        "user": {"type": "string", "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True, "description": "only with stream: true",
                           "properties": {"include_usage": {"type": "boolean", "nullable": True},
                                          "continuous_usage_stats": {
                                              "type": "boolean", "nullable": True,
                                              "description": "usage (so far) on every chunk; implies "
                                                             "include_usage unless that is false"}}},
        # vLLM's extensions
        "return_token_ids": {"type": "boolean", "nullable": True,
                             "description": "prompt_token_ids and per-choice token_ids in the response and chunks"},
        "return_tokens_as_token_ids": {"type": "boolean", "nullable": True,
                                       "description": "logprob tokens written as 'token_id:<id>'"},
        "include_metrics": {"type": "boolean", "nullable": True,
                            "description": "per-request timing in 'metrics' (n = 1, one prompt)"},
        "priority": _int(-(2**63), 2**63 - 1, nullable=True, description="lower is scheduled first"),
        "use_beam_search": {"type": "boolean", "nullable": True,
                            "description": "beam search of width max(n, best_of); the n best beams"},
        "length_penalty": {**_num(), "description": "beam score = cumulative logprob / length ** length_penalty"},
        "allowed_token_ids": {"type": "array", "nullable": True, "minItems": 1, **({"maxItems": vocab_size} if vocab_size
                                                                                   else {}), "items": token,
                              "description": "only these tokens may be sampled"},
        "logprob_token_ids": {"type": "array", "nullable": True, "minItems": 1, "maxItems": MAX_LOGPROB_TOKEN_IDS,
                              "items": token, "description": "logprobs of exactly these tokens (needs logprobs)"},
        "truncate_prompt_tokens": _int(-1, nullable=True, description="keep this many prompt tokens (-1: as many "
                                                                      "as fit beside max_tokens)"),
        "truncation_side": {"type": "string", "nullable": True, "enum": ["left", "right", None],
                            "description": "left (default): keep the last tokens; right: the first"},
        **_constraints(),
    }


def _constraints() -> dict[str, Any]:
    """Output constraints (serving/constraints.py): at most one per request."""
    schema = {"type": "object", "description": "a JSON schema"}
    return {
        "response_format": {"type": "object", "nullable": True, "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"}, "schema": schema,
                "strict": {"type": "boolean", "nullable": True}}}}},
        "structured_outputs": {"type": "object", "nullable": True, "description": "exactly one of json, regex, "
                               "choice, grammar, json_object", "properties": {
            "json": {"nullable": True, "oneOf": [schema, {"type": "string"}]},
            "regex": _NULLABLE_STR, "grammar": {**_NULLABLE_STR, "description": "Lark, or GBNF (::= rules)"},
            "choice": {"type": "array", "nullable": True, "minItems": 1, "items": {"type": "string", "minLength": 1}},
            "json_object": {"type": "boolean", "nullable": True},
            "disable_any_whitespace": {"type": "boolean"}, "disable_additional_properties": {"type": "boolean"},
            "disable_fallback": {"type": "boolean"}, "whitespace_pattern": _NULLABLE_STR},
            "additionalProperties": False},
        "guided_json": {"nullable": True, "oneOf": [schema, {"type": "string"}]},
        "guided_regex": _NULLABLE_STR,
        "guided_choice": {"type": "array", "nullable": True, "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "guided_grammar": _NULLABLE_STR,
        "guided_whitespace_pattern": _NULLABLE_STR,
        "guided_decoding_backend": {"type": "string", "nullable": True, "enum": ["auto", "guidance", "llguidance", None]},
    }


def _tools() -> dict[str, Any]:
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean", "nullable": True}}}
    return {
        "tools": {"type": "array", "nullable": True, "maxItems": 128, "items": {
            "type": "object", "required": ["type", "function"],
            "properties": {"type": {"type": "string", "enum": ["function"]}, "function": function}}},
        "tool_choice": {"nullable": True, "description": "needs tools", "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
        "parallel_tool_calls": {"type": "boolean", "nullable": True},
    }


_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}


def _completion_request(cap: int | None, max_n: int, vocab: int | None, k: int) -> dict[str, Any]:
    token = _int(0, vocab - 1 if vocab else None)
    props = _sampling(cap, max_n, vocab)
    props.update({
        "prompt": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": token},
            {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "array", "minItems": 1, "items": token}},
        ]},
        "logprobs": _int(-1, k, nullable=True, description="-1: the whole vocabulary (where --max-logprobs allows)"),
        "echo": {"type": "boolean", "nullable": True, "description": "prepend the prompt (with logprobs: its "
                 "tokens' logprobs too, the first null)"},
        "max_tokens": _int(0, cap, nullable=True, description="0 only with echo: score the prompt, generate nothing"),
        "prompt_logprobs": _int(-1, k, nullable=True,
                                description="vLLM's: top-k logprobs of every prompt token, in choices[].prompt_logprobs"),
    })
    return {"type": "object", "required": ["prompt"], "properties": props}


def _chat_request(cap: int | None, max_n: int, vocab: int | None, k: int) -> dict[str, Any]:
    props = _sampling(cap, max_n, vocab)
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_.-]{0,63}$",
                 "description": "system, developer, user, assistant, tool, or another role the template takes"},
        "content": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "assistant messages only"},
        "tool_call_id": {"type": "string"},
    }}
    props.update({
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": _int(1, cap, nullable=True),
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": _int(-1, k, nullable=True, description="needs logprobs: true"),
        "prompt_logprobs": _int(-1, k, nullable=True, description="vLLM's: the templated prompt's logprobs, in the "
                                "response's prompt_logprobs (not with stream)"),
        "add_generation_prompt": {"type": "boolean", "nullable": True, "description": "default true"},
        "continue_final_message": {"type": "boolean", "nullable": True,
                                   "description": "continue the last (assistant) message; needs "
                                                  "add_generation_prompt: false"},
        "echo": {"type": "boolean", "nullable": True,
                 "description": "the reply starts with the last message's content if it is the assistant's"},
        "chat_template": {"type": "string", "nullable": True, "minLength": 1,
                          "description": "this request's Jinja chat template (sandboxed)"},
        "chat_template_kwargs": {"type": "object", "nullable": True,
                                 "description": "extra template variables"},
        "include_reasoning": {"type": "boolean", "nullable": True,
                              "description": "with --reasoning-parser: false leaves the thinking out; default true"},
        "add_special_tokens": {"type": "boolean", "nullable": True,
                               "description": "special tokens (BOS) on top of the template's; default false"},
        **_tools(),
    })
    return {"type": "object", "required": ["messages"], "properties": props}


def _batch_chat_request(cap: int | None, max_n: int, vocab: int | None, k: int, max_prompts: int) -> dict[str, Any]:
    """vLLM's /v1/chat/completions/batch: messages is a list of conversations; no stream, tools, beam search."""
    props = dict(_chat_request(cap, max_n, vocab, k)["properties"])
    for name in ("stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "use_beam_search",
                 "best_of", "length_penalty", "prompt_logprobs", "n"):
        props.pop(name)
    props["messages"] = {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": props["messages"]}
    return {"type": "object", "required": ["messages"], "properties": props}


_NULLABLE_STR = {"type": "string", "nullable": True}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    **{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"], "properties": {
        "cached_tokens": {"type": "integer", "minimum": 0, "description": "prompt tokens from the prefix cache"}}},
    "completion_tokens_details": {"type": "object", "description": "chat, with --reasoning-parser", "properties": {
        "reasoning_tokens": {"type": "integer", "minimum": 0, "description": "tokens of the thinking"}}}}}
_MS = {"type": "number", "nullable": True, "minimum": 0}
_METRICS = {"type": "object", "nullable": True, "description": "with include_metrics (or "
            "--enable-per-request-metrics); null for n > 1 or several prompts", "properties": {
                k: _MS for k in ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                                 "tokens_per_second")}}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "description": "with return_token_ids"}
_FINISH = {"type": "string", "nullable": True, "enum": ["stop", "length", "tool_calls", "abort", "error", None]}
_PROMPT_LOGPROBS = {"type": "array", "nullable": True, "description": "null first, then {token id: {logprob, rank, "
                    "decoded_token}} per prompt token", "items": {"type": "object", "nullable": True,
                                                                 "additionalProperties": {"type": "object"}}}


def _responses_schemas() -> dict[str, Any]:
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "param": _NULLABLE_STR,
                "code": {"type": "string"}}}}},
        "Usage": _USAGE,
        "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {
                           "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": {
                               "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
                               "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                                              "logprobs": {"type": "object", "nullable": True},
                                              "prompt_logprobs": _PROMPT_LOGPROBS,
                                              "finish_reason": _FINISH, "token_ids": _TOKEN_IDS,
                                              "prompt_token_ids": _TOKEN_IDS}}},
                           "usage": _ref("Usage"), "metrics": _METRICS}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {
                               "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": {"type": "array", "items": {
                                   "type": "object", "required": ["index", "message", "finish_reason"],
                                   "properties": {
                                       "index": {"type": "integer", "minimum": 0},
                                       "message": {"type": "object", "required": ["role", "content"], "properties": {
                                           "role": {"type": "string", "enum": ["assistant"]},
                                           "content": {"type": "string", "nullable": True},
                                           **{k: {"type": "string", "nullable": True,
                                                  "description": "the thinking (with --reasoning-parser)"}
                                              for k in ("reasoning_content", "reasoning")},
                                           "tool_calls": {"type": "array", "items": _TOOL_CALL}}},
                                       "logprobs": {"type": "object", "nullable": True},
                                       "finish_reason": _FINISH, "token_ids": _TOKEN_IDS}}},
                               "usage": _ref("Usage"), "metrics": _METRICS, "prompt_token_ids": _TOKEN_IDS,
                               "prompt_logprobs": _PROMPT_LOGPROBS}},
        "Tokenize": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer", "nullable": True},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": "array", "nullable": True, "items": {"type": "string"}}}},
        "Detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        "TokenizerInfo": {"type": "object", "required": ["eos_token", "chat_template"], "properties": {
            "tokenizer_class": {"type": "string"}, "bos_token": _NULLABLE_STR, "eos_token": _NULLABLE_STR,
            "chat_template": _NULLABLE_STR, "model_max_length": {"type": "integer", "nullable": True}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                                                "properties": {"id": {"type": "string"},
                                                               "object": {"type": "string", "enum": ["model"]},
                                                               "created": {"type": "integer"},
                                                               "owned_by": {"type": "string"},
                                                               "root": {"type": "string"},
                                                               "parent": _NULLABLE_STR}}}}},
    }


# one server-sent event: `data: <chunk JSON>`, or `data: [DONE]` last
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "minLength": 1}}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _ref("Error")}}}


_COMMON_ERRORS = {
    "401": _error("missing or wrong API key"),
    "503": _error("the model is loading, failed to load, or the server is shutting down"),
}


def _generate_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {_JSON: {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the whole response, or an event stream when stream is true", "content": {
                _JSON: {"schema": _ref(response)},
                "text/event-stream": {"schema": _SSE_EVENT}}},
            "400": _error("the body is not valid JSON or a parameter is invalid (the error names it)"),
            "404": _error("the request names a model this server does not serve"),
            "413": _error("the body is larger than --max-body-bytes"),
            "500": _error("the engine step computing this request failed (other requests are unaffected)"),
            **_COMMON_ERRORS,
        },
    }


def _get_op(summary: str, content: dict[str, Any], *, auth: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "ok", "content": content},
                                                            **(_COMMON_ERRORS if auth else {"503": _COMMON_ERRORS["503"]})}}
    if not auth:
        op["security"] = []
    return op


def _tokenize_requests(vocab: int | None) -> dict[str, Any]:
    chat = _chat_request(None, 1, vocab, MAX_LOGPROBS)["properties"]["messages"]
    flag = {"type": "boolean", "nullable": True}
    return {
        "TokenizeRequest": {"type": "object", "description": "exactly one of prompt and messages", "properties": {
            "model": {"type": "string", "nullable": True}, "prompt": {"type": "string"}, "messages": chat,
            "add_special_tokens": {**flag, "description": "default: true for prompt, false for messages"},
            "add_generation_prompt": flag, "continue_final_message": flag, "return_token_strs": flag}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": {"type": "string", "nullable": True},
            "tokens": {"type": "array", "items": _int(0, vocab - 1 if vocab else None)}}},
    }


def _tokenizer_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {_JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "ok", "content": {_JSON: {"schema": _ref(response)}}},
                      "400": _error("the body is not valid JSON or a parameter is invalid (the error names it)"),
                      "404": _error("the request names a model this server does not serve"),
                      "413": _error("the body is larger than --max-body-bytes"), **_COMMON_ERRORS},
    }


def openapi_schema(served_model_names: tuple[str, ...], *, max_tokens_cap: int | None = None, max_n: int = 16,
                   vocab_size: int | None = None, version: str = "0", max_logprobs: int = MAX_LOGPROBS,
                   max_prompts: int = 64, hidden_size: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of this server, with its limits filled in (HIDDEN_SIZE: an embedding export's,
    which adds /v1/embeddings; the other APIs' part: serving/openapi_apis.py)."""
    schemas = _responses_schemas()
    schemas.update(api_schemas(max_tokens_cap, vocab_size, hidden_size))
    schemas["CompletionRequest"] = _completion_request(max_tokens_cap, max_n, vocab_size, max_logprobs)
    schemas["ChatCompletionRequest"] = _chat_request(max_tokens_cap, max_n, vocab_size, max_logprobs)
    schemas["BatchChatCompletionRequest"] = _batch_chat_request(max_tokens_cap, max_n, vocab_size, max_logprobs,
                                                                max_prompts)
    schemas["InvocationRequest"] = {"oneOf": [_ref("ChatCompletionRequest"), _ref("CompletionRequest")]}
    schemas["Invocation"] = {"oneOf": [_ref("ChatCompletion"), _ref("Completion")]}
    schemas.update(_tokenize_requests(vocab_size))
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "octavo OpenAI-compatible server", "version": version,
                 "description": f"serves {', '.join(served_model_names)}"},
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/completions": {"post": _generate_op("text completion", "CompletionRequest", "Completion")},
            "/v1/chat/completions": {"post": _generate_op("chat completion", "ChatCompletionRequest",
                                                          "ChatCompletion")},
            "/v1/chat/completions/batch": {"post": _generate_op(
                "vLLM's batch chat completion: one choice per conversation (never streamed)",
                "BatchChatCompletionRequest", "ChatCompletion")},
            "/invocations": {"post": {**_generate_op(
                "SageMaker-style: a chat completion when the body has 'messages', else a completion ('prompt')",
                "InvocationRequest", "Invocation")}},
            "/tokenize": {"post": _tokenizer_op("token ids of a prompt or a templated chat (vLLM's shape)",
                                                "TokenizeRequest", "Tokenize")},
            "/detokenize": {"post": _tokenizer_op("the text of token ids (special tokens kept)",
                                                  "DetokenizeRequest", "Detokenize")},
            "/tokenizer_info": {"get": _get_op("the tokenizer's special tokens, chat template and context length",
                                               {_JSON: {"schema": _ref("TokenizerInfo")}})},
            "/v1/models": {"get": _get_op("the served model names", {_JSON: {"schema": _ref("ModelList")}})},
            "/health": {"get": _get_op("200 once the model is loaded (no API key needed)", {}, auth=False)},
            "/version": {"get": _get_op("octavo's version", {_JSON: {"schema": {
                "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}})},
            "/metrics": {"get": _get_op("Prometheus metrics", text)},
            OPENAPI_PATH: {"get": _get_op("this document", {_JSON: {"schema": {"type": "object"}}})},
            **api_paths(hidden_size),
        },
    }


def server_schema(state: Any) -> dict[str, Any]:
    """The document for a running server (an octavo.serving.state.ServerState): its names and limits."""
    from octavo.version import __version__

    cfg = state.config
    lim = state.limits
    model = state.engine.embedding_model if state.engine is not None else None
    hidden = model.hidden_size if model is not None and model.config is not None else None
    return openapi_schema(cfg.served_model_names, max_tokens_cap=cfg.max_tokens_cap, max_n=cfg.max_n,
                          vocab_size=lim.vocab_size if lim is not None else None, version=__version__,
                          max_logprobs=lim.max_logprobs if lim is not None else MAX_LOGPROBS,
                          max_prompts=lim.max_prompts if lim is not None else 64, hidden_size=hidden)


def add_openapi_route(app: web.Application, schema: Any) -> None:
    """Serve GET /openapi.json. SCHEMA is a dict, or a callable returning one (evaluated per request, so it
    can reflect facts known only once the model has loaded)."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(schema() if callable(schema) else schema)

    app.router.add_get(OPENAPI_PATH, handler)


__all__ = ["OPENAPI_PATH", "add_openapi_route", "openapi_schema", "server_schema"]
