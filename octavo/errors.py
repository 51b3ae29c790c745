"""Exception classes. Every error a user can cause has its own class and a message that says what to do."""
from __future__ import annotations


class OctavoError(Exception):
    """Base class of every error octavo raises on purpose."""


class ModelFormatError(OctavoError):
    """A model folder, checkpoint or manifest is missing, broken, unsafe or of an unknown version."""


class UnsupportedArchitectureError(ModelFormatError):
    """The checkpoint's architecture is not one octavo can export."""


class UnsafePathError(ModelFormatError):
    """A path named inside a model folder escapes that folder (.., absolute path, symlink out)."""


class OpLibraryError(OctavoError):
    """The ONNX Runtime custom-op library is missing or failed to build/load."""


class BackendUnavailableError(OctavoError):
    """A backend (e.g. TensorRT) cannot run on this machine; the message says why."""


class InvalidRequestError(OctavoError, ValueError):
    """A request's prompt or sampling parameters are invalid (maps to HTTP 400)."""


class ExportMismatchError(ModelFormatError, InvalidRequestError):
    """An export folder was named with a weight format, kernel or quantization option other than the one it was
    exported with (fixed at export time). Both a model-format and an invalid-request error: the folder is fine,
    what was asked of it is not."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context or the KV pool. `param` names the request
    field to change ("prompt" or "max_tokens"), for the server's error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownRequestError(OctavoError, KeyError):
    """abort() or a lookup named a request id the engine does not know."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown request"


class OverloadedError(OctavoError):
    """A bounded queue is full (e.g. constraints waiting to compile): retry shortly (HTTP 503 with Retry-After)."""


class EngineDeadError(OctavoError):
    """The engine's step loop stopped (shutdown or fatal error); no new requests are accepted."""


class StepFailedError(OctavoError):
    """The backend failed during a step; only the requests of that step are ended with this error."""


class TraceFormatError(OctavoError):
    """A trace file (one JSON row per engine step) is missing, unreadable or has malformed rows."""
