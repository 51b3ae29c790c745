"""OpenAIServer: listen first, load the model behind it, drain gracefully on shutdown.

    server = OpenAIServer(config, lambda: AsyncEngine(engine_args))
    host, port = await server.start("127.0.0.1", 8000)   # /health answers 503 until the model is ready
    await server.wait_ready()
    ...
    await server.shutdown()   # stop accepting, let in-flight requests finish (timeout), abort the rest
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from octavo.errors import OctavoError
from octavo.runtime.reasoning import TokenPieces, get_reasoning_format, markers_are_special
from octavo.serving.api_error import ApiError
from octavo.serving.app import build_app
from octavo.serving.connections import GuardedSite, RateLimitedLoopErrors
from octavo.serving.metrics import ServerMetrics
from octavo.serving.protocol import Limits
from octavo.serving.state import ServerConfig, ServerState
from octavo.serving.vllm_metrics import cache_config_info

log = logging.getLogger(__name__)

CLEANUP_GRACE_S = 3.0  # after the drain and the engine's abort, handlers get this long to write their last bytes


class OpenAIServer:
    def __init__(self, config: ServerConfig, load_engine: Callable[[], Any], *, shutdown_timeout: float = 30.0) -> None:
        """load_engine() builds the (not yet started) AsyncEngine; it runs in a worker thread."""
        self._load_engine = load_engine
        self._shutdown_timeout = shutdown_timeout
        self.state = ServerState(config=config, metrics=ServerMetrics(config.served_model_names[0], self._stats,
                                                                      lambda: self.state.in_flight,
                                                                      config.metric_names))
        self.app = build_app(self.state)
        self._runner: web.AppRunner | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._site: GuardedSite | None = None
        self._loop_errors = RateLimitedLoopErrors()

    def _stats(self) -> Any | None:
        engine = self.state.engine
        return engine.stats() if engine is not None else None

    async def start(self, host: str = "127.0.0.1", port: int = 8000, *, sock: socket.socket | None = None) -> tuple[str, int]:
        """Start listening (on SOCK if given), then load the model in the background. Returns the bound address.

        Connections go through a ConnectionLimiter (config.max_connections, a 503 beyond); aiohttp's keep-alive
        timer, which runs from a connection's start and between requests, is the header timeout
        (config.header_timeout): a client that has not sent complete headers by then is disconnected."""
        cfg = self.state.config
        # AppRunner's shutdown_timeout is the grace handlers get in runner.cleanup(), after the drain (which
        # already spent --shutdown-timeout) and the engine's abort: only writing the last chunks is left.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=CLEANUP_GRACE_S, keepalive_timeout=cfg.header_timeout)
        await self._runner.setup()
        self._loop_errors.install(asyncio.get_running_loop())
        site = GuardedSite(self._runner, sock if sock is not None else _listening_socket(host, port),
                           cfg.max_connections)
        await site.start()
        self._site = site
        addr = self._runner.addresses[0]
        self._load_task = asyncio.create_task(self._load(), name="octavo-load-model")
        return addr[0], addr[1]

    async def _load(self) -> None:
        """Build and start the engine. If anything fails once the engine exists (its thread may be running, its
        backend holds the KV pool), it is shut down here: a server that failed to load holds no engine."""
        st = self.state
        engine: Any | None = None
        try:
            engine = await asyncio.to_thread(self._load_engine)
            # the tokenizer's llguidance bridge holds the GIL for ~0.5-1.5 s: built now, not at the first constraint
            await asyncio.to_thread(engine.engine.structured.warm)
            await engine.start()
            tokenizer, vocab_size, max_model_len = _engine_facts(engine)
            st.tokenizer = tokenizer
            st.max_model_len = max_model_len
            max_logprobs = int(getattr(engine.engine.args, "max_logprobs", 20))
            parser = engine.engine.args.reasoning_parser
            if parser is not None:
                st.reasoning, st.token_pieces = get_reasoning_format(parser), TokenPieces(tokenizer)
                st.reasoning_keeps_specials = markers_are_special(st.reasoning, tokenizer)
            st.limits = Limits(vocab_size=vocab_size, max_tokens_cap=st.config.max_tokens_cap, max_n=st.config.max_n,
                               tool_call_parser=st.config.tool_call_parser, max_model_len=max_model_len,
                               max_logprobs=vocab_size if max_logprobs == -1 else max_logprobs)
            st.metrics.cache_info = _cache_info(engine)
            st.engine = engine
            log.info("model %s ready", st.model_name)
        except BaseException as exc:  # reported through /health, wait_ready() and the CLI
            if isinstance(exc, OctavoError):  # a user error (bad folder, bad argument): the message says it all
                log.error("loading the model failed: %s", exc)
            else:
                log.error("loading the model failed", exc_info=exc)
            st.load_error = f"{type(exc).__name__}: {exc}"
            if engine is not None:
                await _discard(engine)
            if not isinstance(exc, Exception):
                raise  # cancellation, KeyboardInterrupt: after the cleanup
        finally:
            self._ready.set()

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raise ApiError(503) carrying the reason if loading failed."""
        await self._ready.wait()
        self.state.ready_engine()

    async def shutdown(self) -> None:
        """Stop accepting, wait up to shutdown_timeout for in-flight requests, abort what is left, stop the engine.

        Aborting goes through the engine (not by cancelling handlers), so every open stream still gets its
        last chunk (finish_reason "abort") and [DONE], and a non-streamed request its response."""
        self.state.draining = True
        runner, self._runner = self._runner, None
        if runner is not None:
            for site in list(runner.sites):
                await site.stop()  # no new connections from here on
            await self._drain(self._shutdown_timeout)
        self.state.stop_reading.set()  # requests still sending their body get 503 now (a body may never end)
        if self._load_task is not None and not self._load_task.done():
            await asyncio.wait([self._load_task])
        engine, self.state.engine = self.state.engine, None
        if engine is not None:
            await engine.shutdown()  # what is still running ends with "abort"; its handlers write the end
        if runner is not None:
            await runner.cleanup()  # handlers finish writing (CLEANUP_GRACE_S at most), then connections close
        self._loop_errors.uninstall()

    async def _drain(self, timeout: float) -> None:
        """Wait until no request handler is running (or TIMEOUT seconds pass). Handlers, not the engine's stats:
        those change only after a step, so a request admitted just before would look like no work at all."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket for HOST:PORT, as TCPSite would make it."""
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


async def _discard(engine: Any) -> None:
    """Shut down an engine that will never serve (its thread, its backend); a failure here is only logged."""
    try:
        await engine.shutdown()
    except Exception:  # noqa: BLE001 - the load error is the one to report
        log.exception("shutting down the engine that failed to start also failed")


def _cache_info(engine: Any) -> dict[str, str]:
    """vllm:cache_config_info's labels for a started AsyncEngine's KV pool."""
    core = engine.engine
    dtype = getattr(core.backend, "kv_cache_dtype", None) or core.args.kv_cache_dtype
    return cache_config_info(core.block_size, core.num_blocks, str(dtype), core.args.enable_prefix_caching,
                             core.args.kv_cache_memory)


def _engine_facts(engine: Any) -> tuple[Any, int, int | None]:
    """(tokenizer, vocab size, max model length) of a started AsyncEngine (it wraps an LLMEngine)."""
    core = engine.engine
    return engine.tokenizer, int(core.vocab_size), int(core.max_model_len)


__all__ = ["ApiError", "OpenAIServer", "ServerConfig"]
