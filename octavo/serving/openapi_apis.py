"""The OpenAPI description of the other APIs the server speaks — /v1/responses, /v1/messages,
/v1/messages/count_tokens and (on an embedding export) /v1/embeddings — merged into serving/openapi.py's
document, so the schemathesis fuzzer reaches them too. Written by hand from what their modules accept
(serving/openapi_responses.py, anthropic_messages.py, embeddings.py), with this server's limits filled in; only
the fields that shape a valid request are described (the modules accept more, and refuse what they do not take).
"""
from __future__ import annotations

from typing import Any

_JSON = "application/json"
_STR = {"type": "string", "nullable": True}
_BOOL = {"type": "boolean", "nullable": True}
_SSE = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "minLength": 1}}}
_OBJECT = {"type": "object"}


def _int(lo: int | None, hi: int | None, nullable: bool = True) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer", "nullable": nullable}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _num(lo: float, hi: float | None, lo_open: bool = False) -> dict[str, Any]:
    return {"type": "number", "nullable": True, "minimum": lo, **({"maximum": hi} if hi is not None else {}),
            **({"exclusiveMinimum": True} if lo_open else {})}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(schema: str, codes: tuple[str, ...], outer: tuple[str, ...] = ("401", "413")) -> dict[str, Any]:
    """Error responses: CODES in SCHEMA's shape; OUTER (the key check, the body cap: before the route) in OpenAI's."""
    out = {code: {"description": "an error", "content": {_JSON: {"schema": _ref(schema)}}} for code in codes}
    out.update({code: {"description": "an error", "content": {_JSON: {"schema": _ref("Error")}}} for code in outer})
    return out


def _op(summary: str, request: str, stream: bool, errors: dict[str, Any]) -> dict[str, Any]:
    content: dict[str, Any] = {_JSON: {"schema": _OBJECT}}
    if stream:
        content["text/event-stream"] = {"schema": _SSE}
    return {"summary": summary, "requestBody": {"required": True, "content": {_JSON: {"schema": _ref(request)}}},
            "responses": {"200": {"description": "ok", "content": content}, **errors}}


def api_schemas(max_tokens_cap: int | None, vocab_size: int | None, hidden_size: int | None) -> dict[str, Any]:
    """The request and error schemas (hidden_size: an embedding export's, else None: no embeddings)."""
    text_message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]}, "content": {"type": "string"}}}
    responses = {"type": "object", "required": ["input"], "properties": {
        "model": _STR, "instructions": _STR, "stream": _BOOL, "parallel_tool_calls": _BOOL,
        "input": {"oneOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": text_message}]},
        "max_output_tokens": _int(1, max_tokens_cap), "temperature": _num(0.0, None), "top_p": _num(0.0, 1.0, True),
        "text": {"type": "object", "nullable": True, "properties": {"format": {
            "type": "object", "required": ["type"], "properties": {"type": {"type": "string",
                                                                            "enum": ["text", "json_object"]}}}}}}}
    anthropic_message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["user", "assistant"]}, "content": {"type": "string"}}}
    count = {"type": "object", "required": ["messages"], "properties": {
        "model": _STR, "system": _STR,
        "messages": {"type": "array", "minItems": 1, "items": anthropic_message}}}
    messages = {"type": "object", "required": ["messages", "max_tokens"], "properties": {
        **count["properties"], "max_tokens": _int(1, max_tokens_cap, nullable=False), "stream": _BOOL,
        "stop_sequences": {"type": "array", "nullable": True, "maxItems": 16, "items": {"type": "string", "minLength": 1}},
        "temperature": _num(0.0, 1.0), "top_p": _num(0.0, 1.0, True), "top_k": _int(0, None)}}
    out = {"ResponsesRequest": responses, "MessagesRequest": messages, "CountTokensRequest": count,
           "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
               "type": {"type": "string", "enum": ["error"]}, "error": {
                   "type": "object", "required": ["type", "message"],
                   "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}}
    if hidden_size is not None:
        token = {"type": "integer", "minimum": 0, **({"maximum": vocab_size - 1} if vocab_size else {})}
        out["EmbeddingRequest"] = {"type": "object", "required": ["input"], "properties": {
            "model": _STR, "user": _STR, "normalize": _BOOL, "dimensions": _int(1, hidden_size),
            "encoding_format": {"type": "string", "nullable": True, "enum": ["float", "base64", None]},
            "input": {"oneOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "minItems": 1, "maxItems": 16, "items": {"type": "string", "minLength": 1}},
                                {"type": "array", "minItems": 1, "maxItems": 64, "items": token}]}}}
    return out


def api_paths(hidden_size: int | None) -> dict[str, Any]:
    codes = ("400", "404", "500", "503")
    paths = {
        "/v1/responses": {"post": _op("OpenAI's Responses API, stateless", "ResponsesRequest", True,
                                      _errors("Error", codes))},
        "/v1/messages": {"post": _op("Anthropic's Messages API", "MessagesRequest", True,
                                     _errors("AnthropicError", codes))},
        "/v1/messages/count_tokens": {"post": _op("the input tokens of a Messages request", "CountTokensRequest",
                                                  False, _errors("AnthropicError", codes))},
    }
    if hidden_size is not None:
        paths["/v1/embeddings"] = {"post": _op("embeddings (an embedding export)", "EmbeddingRequest", False,
                                               _errors("Error", codes))}
    return paths


__all__ = ["api_paths", "api_schemas"]
