"""ApiError: an HTTP error in OpenAI's JSON shape {"error": {"message", "type", "param", "code"}}, one rule for all.

- HTTP status: what vLLM answers for the same cause (400 for a bad parameter or a prompt that cannot fit, 401,
  404 for an unknown model or route, 413, 500 for a failed step, 503 while loading, draining or dead).
- `type`: OpenAI's category for the status (`invalid_request_error` for 4xx, `authentication_error` for 401,
  `server_error` for 5xx).
- `code`: always a short snake_case string a client can switch on, OpenAI's word where OpenAI has one
  (`context_length_exceeded`, `model_not_found`, `invalid_api_key`); never an exception class name, never a
  number, never null. docs/serving.md lists them.
- `param`: the request field at fault, or null.
- `message`: what was wrong and what to change.
"""
from __future__ import annotations

from typing import Any

from octavo.errors import (EngineDeadError, InvalidRequestError, OctavoError, OverloadedError, PromptTooLongError,
                           StepFailedError)

# HTTP status -> OpenAI's error "type"
_TYPES = {401: "authentication_error"}
# HTTP status -> the code an error of that status carries unless it names a more precise one
STATUS_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    431: "request_header_fields_too_large",
    500: "internal_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def status_code(status: int) -> str:
    return STATUS_CODES.get(status, f"http_{status}")


class ApiError(Exception):
    """Raised by request parsing and route handlers; the app turns it into a JSON error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.headers = headers  # extra response headers (Retry-After on a 503 "overloaded")
        self.status = status
        self.message = message
        self.param = param
        self.code = code or status_code(status)
        self.type = type or error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "server_error", param: str | None = None,  # noqa: A002
               code: str = "internal_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400: `invalid_value` when a named parameter is wrong, `invalid_request` otherwise (unless CODE)."""
    return ApiError(400, message, param=param, code=code or ("invalid_value" if param else "invalid_request"))


def from_exception(exc: BaseException) -> ApiError:
    """The ApiError for an exception raised while a request runs (octavo's typed errors; anything else is a 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, str(exc), param=getattr(exc, "param", None), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), getattr(exc, "param", None))
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, OverloadedError):
        return ApiError(503, str(exc), code="overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, StepFailedError):
        return ApiError(500, f"generation failed: {exc}", code="step_failed")
    if isinstance(exc, OctavoError):
        return ApiError(500, f"generation failed: {exc}", code="generation_failed")
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}")
