"""The HTTP front of `octavo triton`: a small reverse proxy that checks each request before tritonserver parses it.

Why: tritonserver's HTTP frontend parses JSON bodies recursively; a body nested ~50,000 levels deep overflows its
stack and kills the server with SIGSEGV (every stream on it dies; depth 30,000 still gets a 400 — measured with the
tritonserver 2.51 of nvidia-pytriton, tests/test_triton_front.py). Triton has no option to bound the depth or the
body size, so `octavo triton` binds tritonserver's own HTTP port to 127.0.0.1 (a private port) and serves the
public HTTP port from this front, which:

- refuses a body larger than `max_body_bytes` (413) before reading it all;
- refuses a JSON body nested deeper than `max_json_depth` (400; default 64 — Triton's KServe requests nest a
  handful of levels, tensors one level per dimension), counting brackets outside strings. With the KServe binary
  tensor extension (`Inference-Header-Content-Length: N`), only the first N bytes are JSON;
- forwards everything else unchanged and streams the answer back chunk by chunk (generate_stream's SSE
  included); a client that hangs up closes the upstream request, which Triton cancels.

gRPC goes to tritonserver directly: protobuf's parser bounds nesting itself (100 levels) and octavo's tensors
are flat.
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from octavo.triton_server.front_limits import MAX_BODY_BYTES, MAX_JSON_DEPTH

log = logging.getLogger(__name__)

HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length"})
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string (skipped whole) or a bracket


def json_depth(data: bytes, limit: int) -> int:
    """How deep DATA's brackets nest outside strings, counting up to LIMIT + 1 (then it stops: enough to refuse)."""
    depth = deepest = 0
    for match in _TOKENS.finditer(data):
        ch = match.group()[:1]
        if ch in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in b"]}":
            depth -= 1
    return deepest


@dataclass(slots=True)
class FrontConfig:
    upstream: str  # "http://127.0.0.1:PORT" of tritonserver's own HTTP server
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_depth: int = MAX_JSON_DEPTH


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)  # Triton's own error shape


def check_body(body: bytes, headers: Any, config: FrontConfig) -> web.Response | None:
    """The refusal for BODY, or None when it may go to Triton."""
    json_part = body
    header_len = headers.get("Inference-Header-Content-Length")
    if header_len is not None:
        try:
            n = int(header_len)
        except ValueError:
            return _error(400, "Inference-Header-Content-Length must be an integer")
        if not 0 <= n <= len(body):
            return _error(400, f"Inference-Header-Content-Length {n} is outside the body's {len(body)} bytes")
        json_part = body[:n]
    depth = json_depth(json_part, config.max_json_depth)
    if depth > config.max_json_depth:
        return _error(400, f"the JSON body nests deeper than {config.max_json_depth} levels; octavo's Triton front "
                           "refuses it (tritonserver's parser would overflow its stack on very deep bodies)")
    return None


def make_app(config: FrontConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    state: dict[str, ClientSession] = {}

    async def open_session(app: web.Application) -> None:
        state["session"] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10), auto_decompress=False)

    async def close_session(app: web.Application) -> None:
        await state["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > config.max_body_bytes:
            return _error(413, f"the request body is larger than {config.max_body_bytes} bytes")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is larger than {config.max_body_bytes} bytes")
        refusal = check_body(body, request.headers, config)
        if refusal is not None:
            return refusal
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        url = config.upstream + request.rel_url.raw_path_qs
        try:
            upstream = await state["session"].request(request.method, url, data=body or None, headers=headers,
                                                      allow_redirects=False)
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("Triton front: %s %s failed upstream: %s", request.method, request.path, exc)
            return _error(502, f"tritonserver did not answer: {exc}")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS:
                    response.headers[key] = value
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (OSError, asyncio.TimeoutError) as exc:  # upstream died mid-answer: end this answer here
                log.warning("Triton front: %s %s broke off upstream: %s", request.method, request.path, exc)
                return response
            await response.write_eof()
            return response

    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


async def start_front(config: FrontConfig, host: str, port: int) -> web.AppRunner:
    """Serve the front on HOST:PORT; returns the runner (await runner.cleanup() to stop it)."""
    runner = web.AppRunner(make_app(config), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
