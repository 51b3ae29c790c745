"""The aiohttp application: OpenAI-compatible routes over one shared AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming over SSE), GET /v1/models,
/health, /version, /metrics, /openapi.json. Errors leave in OpenAI's JSON shape. Every route except /health needs the
API key when one is set. While the model loads (or the server drains) the API answers 503.

This module owns build_app (the route table), the middlewares (in-flight count, errors in the API's shape,
the API key) and the small routes. The generation routes are in serving/routes.py, their response shapes in
serving/shapes.py, the tokenizer routes in serving/tokenize_routes.py; what they share is serving/state.py.
"""
from __future__ import annotations

import hmac
import logging
from typing import Any

from aiohttp import web

from octavo.version import __version__
from octavo.serving import responses as R
from octavo.serving.api_error import ApiError
from octavo.serving.lora_models import adapter_models
from octavo.serving.lora_routes import add_lora_routes
from octavo.serving.metrics import CONTENT_TYPE
from octavo.serving.openapi import add_openapi_route, server_schema
from octavo.serving.anthropic_messages import count_tokens, messages
from octavo.serving.embeddings import embeddings
from octavo.serving.openai_responses import create_response
from octavo.serving.routes import batch_chat_completions, chat_completions, completions, invocations
from octavo.serving.state import CLOSE_AFTER, STATE, ServerState
from octavo.serving.tokenize_routes import add_tokenize_routes

log = logging.getLogger(__name__)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_count, _errors, _auth], client_max_size=state.config.max_body_bytes)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/chat/completions/batch", batch_chat_completions)
    app.router.add_post("/invocations", invocations)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    add_tokenize_routes(app, STATE)  # /tokenize, /detokenize, /tokenizer_info (vLLM's)
    if state.config.allow_runtime_lora_updating:
        add_lora_routes(app)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    add_openapi_route(app, lambda: server_schema(state))
    return app


# ---------------------------------------------------------------------------------------------------
# middlewares


def _json_error(err: ApiError, request: web.Request | None = None) -> web.Response:
    resp = web.json_response(err.body(), status=err.status, headers=err.headers)
    if request is not None and request.get(CLOSE_AFTER):
        resp.force_close()
    return resp


@web.middleware
async def _count(request: web.Request, handler: Any) -> web.StreamResponse:
    st = request.app[STATE]
    st.in_flight += 1
    try:
        return await handler(request)
    finally:
        st.in_flight -= 1


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _json_error(err, request)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].config.max_body_bytes
        return _json_error(ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                         "(--max-body-bytes)", code="request_too_large"))
    except web.HTTPException as exc:  # unknown route, wrong method, ...
        if exc.status < 400:
            raise
        return _json_error(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
    except Exception as exc:  # noqa: BLE001 - a bug must still answer in the API's error shape
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _json_error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


ANTHROPIC_PREFIX = "/v1/messages"  # the routes of Anthropic's Messages API


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].config.api_key
    if key is not None and request.path != "/health":
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        # Anthropic's header (the anthropic SDK sends it), on Anthropic's routes only: elsewhere the OpenAI scheme
        x_api_key = request.headers.get("x-api-key") if request.path.startswith(ANTHROPIC_PREFIX) else None
        if x_api_key is not None and not given:
            scheme, token = "bearer", x_api_key
        # bytes compared: a header with bytes that are not UTF-8 reaches us with surrogate escapes
        given_key = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_key, key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                                f"<key>' on {ANTHROPIC_PREFIX}*)", code="invalid_api_key")
    return await handler(request)


# ---------------------------------------------------------------------------------------------------
# small routes


async def health(request: web.Request) -> web.Response:
    request.app[STATE].ready_engine()
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()  # engine.stats() is a snapshot: never waits for a step
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    out = R.model_list(st.config.served_model_names, st.created, st.max_model_len)
    out["data"] += adapter_models(st, st.created)  # LoRA adapters, with their base as parent
    return web.json_response(out)


__all__ = ["build_app"]
