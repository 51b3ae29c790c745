"""What the OpenAI server's handlers share: ServerConfig (the command line's server options), ServerState (the
config, the metrics, the engine and model facts once loaded, the drain's flags), and the keys they are found
under: STATE on the application, CLOSE_AFTER on a request. The app (serving/app.py), its routes
(serving/routes.py, serving/tokenize_routes.py) and the server's lifecycle (serving/server.py) import this;
it imports none of them.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.reasoning import ReasoningFormat, TokenPieces
from octavo.serving.api_error import ApiError
from octavo.serving.metrics import ServerMetrics
from octavo.serving.protocol import Limits


@dataclass(slots=True)
class ServerConfig:
    served_model_names: tuple[str, ...]  # the first is the name responses carry
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_tokens_cap: int | None = None
    max_n: int = 16
    per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics: "metrics" in every response
    header_timeout: float = 30.0  # seconds to send complete headers, from connect or the previous response
    body_timeout: float = 60.0  # seconds to send the whole body once the headers are in (408 after)
    max_connections: int = 1024  # open connections; more get 503 too_many_connections at once
    special_tokens_in_content: bool = False  # parse special-token strings in chat messages as control tokens
    tool_call_parser: str | None = None  # --tool-call-parser (hermes, llama3_json): enables tool_choice "auto"
    metric_names: str = "both"  # --metric-names: /metrics under octavo:*, vLLM's vllm:* (serving/vllm_metrics.py) or both
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes)


@dataclass(slots=True)
class ServerState:
    """What the routes share. `engine` and the model facts are set once the model is loaded and started."""

    config: ServerConfig
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    engine: AsyncEngine | None = None
    tokenizer: Any | None = None
    limits: Limits | None = None
    max_model_len: int | None = None
    reasoning: ReasoningFormat | None = None  # the engine's reasoning parser (EngineArgs.reasoning_parser)
    token_pieces: TokenPieces | None = None  # each token's text, for counting reasoning tokens
    reasoning_keeps_specials: bool = False  # its markers are special tokens: chat text keeps special tokens
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0  # requests whose handler is running (the drain waits for them)
    stop_reading: asyncio.Event = field(default_factory=asyncio.Event)  # set when the drain ends: bodies still
    # being received get 503 (a body that never ends must not hold shutdown)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        if self.engine is None:
            raise ApiError(503, "the model is still loading; retry when /health returns 200", code="loading")
        if self.engine.dead_reason is not None:  # the step loop died: /health must say so, for a supervisor
            raise ApiError(503, f"the engine is not running: {self.engine.dead_reason}", code="engine_dead")
        return self.engine


STATE = web.AppKey("octavo_state", ServerState)
CLOSE_AFTER = web.RequestKey("octavo_close_after", bool)  # request key: answer, then close the connection (a body left unread)


__all__ = ["CLOSE_AFTER", "STATE", "ServerConfig", "ServerState"]
