"""The server's front door: a connection limit with a clean refusal, and rate-limited loop error logs.

aiohttp accepts every connection the kernel hands it and keeps each one as long as the client likes. An
attacker that opens connections and never finishes a request (slowloris) fills the process's file
descriptors; asyncio's accept loop then fails with EMFILE and logs a traceback per retry. Here:

- `GuardedSite` listens through `ConnectionLimiter`, which counts live connections; past the limit a new
  connection gets an immediate `503` in OpenAI's error shape (`code: "too_many_connections"`,
  `Retry-After`) and is closed. The effective limit is also kept below the process's open-file limit, so
  accept() itself never runs out of descriptors.
- Header and idle timeouts are aiohttp's keep-alive timer (it runs from the connection's start and after
  every response until the next request's headers are complete; a partial header does not extend it);
  body timeouts are applied by the routes (octavo.serving.routes).
- `RateLimitedLoopErrors` replaces the event loop's exception handler while the server runs: each kind of
  error is logged once per interval, with a count of what was suppressed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from octavo.serving.api_error import error_body

log = logging.getLogger(__name__)

FD_RESERVE = 64  # descriptors kept free beyond those open at start: model files, pipes, the engine's own
REFUSAL_LINGER_S = 1.0  # how long a refused connection is read (and discarded) so the client sees the 503


def effective_connection_limit(requested: int) -> int:
    """REQUESTED, lowered so that this many connections never exhaust the open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a modest number
        open_now = 32
    room = max(1, soft - open_now - FD_RESERVE)
    if room < requested:
        log.warning("--max-connections %d lowered to %d: the open-file limit is %d (raise it with `ulimit -n`)",
                    requested, room, soft)
    return min(requested, room)


def raise_open_file_limit() -> None:
    """Raise the soft open-file limit to the hard one (as vLLM does), so the connection limit can be met."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.debug("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)


def _refusal_bytes() -> bytes:
    body = json.dumps(error_body("the server has too many open connections; retry shortly",
                                 type="server_error", code="too_many_connections")).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


_REFUSAL = _refusal_bytes()


class _Refused(asyncio.Protocol):
    """Answers 503 and closes. It reads (and drops) what the client sends for a moment first, so the client's
    request is not met with a reset before it can read the answer."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(_REFUSAL)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        if self._transport is not None:
            self._transport.close()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted while it lives (every call passes through)."""

    __slots__ = ("_inner", "_limiter", "_lost")

    def __init__(self, inner: asyncio.Protocol, limiter: ConnectionLimiter) -> None:
        self._inner, self._limiter, self._lost = inner, limiter, False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._lost:
            self._lost = True
            self._limiter.live -= 1
        self._inner.connection_lost(exc)


@dataclass(slots=True)
class ConnectionLimiter:
    """The protocol factory a listening socket uses: aiohttp's handler while fewer than LIMIT connections live,
    a 503 refusal beyond."""

    server: Callable[[], asyncio.Protocol]  # aiohttp's web.Server (a protocol factory)
    limit: int
    live: int = 0
    refused: int = 0
    _last_warning: float = field(default=-1e9)

    def __call__(self) -> asyncio.Protocol:
        if self.live >= self.limit:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_warning >= 10.0:
                self._last_warning = now
                log.warning("connection limit reached (%d open): refusing new connections with 503 "
                            "(%d refused so far; --max-connections)", self.live, self.refused)
            return _Refused()
        self.live += 1
        return _Counted(self.server(), self)


class GuardedSite(web.SockSite):
    """A SockSite whose connections go through a ConnectionLimiter."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, max_connections: int, **kwargs: Any) -> None:
        super().__init__(runner, sock, **kwargs)
        self._max_connections = max_connections
        self.limiter: ConnectionLimiter | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner (SockSite.start would also listen)
        server = self._runner.server
        assert server is not None
        self.limiter = ConnectionLimiter(server, effective_connection_limit(self._max_connections))
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.limiter, sock=self._sock, ssl=self._ssl_context,
                                                backlog=self._backlog)


@dataclass(slots=True)
class RateLimitedLoopErrors:
    """An event-loop exception handler that logs each kind of error at most once per INTERVAL seconds."""

    interval: float = 10.0
    _seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    _previous: Any = None
    _loop: asyncio.AbstractEventLoop | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._previous = loop, loop.get_exception_handler()
        loop.set_exception_handler(self)

    def uninstall(self) -> None:
        if self._loop is not None:
            self._loop.set_exception_handler(self._previous)
            self._loop = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        key = f"{context.get('message', '')}|{type(exc).__name__ if exc is not None else ''}"
        now = time.monotonic()
        last, suppressed = self._seen.get(key, (-1e9, 0))
        if now - last < self.interval:
            self._seen[key] = (last, suppressed + 1)
            return
        if len(self._seen) > 256:  # keys are messages, not client data, but keep the table small regardless
            self._seen.clear()
        self._seen[key] = (now, 0)
        if suppressed:
            context = {**context, "message": f"{context.get('message', '')} (and {suppressed} more like it in the "
                                              f"last {self.interval:.0f} s, not logged)"}
        if self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)
