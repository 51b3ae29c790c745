"""Run an OpenAIServer on its own event loop in a background thread (tests, notebooks, benchmarks).

    with ServerThread(server) as s:          # binds a free loopback port, waits for the model
        openai.OpenAI(base_url=s.base_url + "/v1", api_key="x")...
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

from octavo.serving.server import OpenAIServer

log = logging.getLogger(__name__)


class ServerThread:
    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self.host, self.port = self._sock.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="octavo-server", daemon=True)
        self._started = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, wait_ready: bool = True, timeout: float = 300.0) -> ServerThread:
        """Start the loop and the server (and wait for the model). If that fails (the model does not load, the
        server cannot start), everything is stopped again -- server, engine, loop thread, socket -- and the
        error raised: `with ServerThread(...)` never runs its __exit__ then, so nothing else would."""
        self._thread.start()
        self._started = True
        try:
            self.call(self.server.start(sock=self._sock), timeout)
            if wait_ready:
                self.call(self.server.wait_ready(), timeout)
        except BaseException:
            try:
                self.stop(timeout)
            except Exception:  # noqa: BLE001 - the start failure is the error to raise
                log.exception("stopping the server after its failed start also failed")
            raise
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Shut the server down (graceful drain), stop the loop thread and close the socket. Idempotent."""
        if not self._started:
            self._sock.close()
            return
        self._started = False
        try:
            self.call(self.server.shutdown(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()
            self._sock.close()  # the site closes it when it started; not when the start failed before that

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
