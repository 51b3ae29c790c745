"""ApiError: an HTTP error in OpenAI's JSON shape {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Any

# HTTP status -> OpenAI's error "type" string
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """Raised by request parsing and route handlers; the app turns it into a JSON error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 type: str | None = None) -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "server_error", param: str | None = None,  # noqa: A002
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
