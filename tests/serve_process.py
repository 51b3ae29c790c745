"""`octavo serve` in its own process for the tests that need a real server: start it on a free port, wait for the
state "ready" (/health answers 200), stop it. One copy of the start/wait/stop the server tests shared; and
`serve_in_thread`, the same app in the test's process (a ServerThread on a free port) over a real AsyncEngine."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.state import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer


def start_serve(args: list[str], ready_s: float = 120) -> tuple[subprocess.Popen, str]:
    """Run `octavo serve ARGS` (ARGS should include --port 0); return the process and its base URL once ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "octavo", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    assert m, line
    url = m.group(1)
    deadline = time.monotonic() + ready_s
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, \
            proc.stdout.read() if proc.poll() is not None else "octavo serve did not become ready"
        time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serving(args: list[str], ready_s: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    proc = None
    try:
        proc, url = start_serve(args, ready_s)
        yield proc, url
    finally:
        if proc is not None:
            stop(proc)


@contextlib.contextmanager
def serve_in_thread(engine_args: EngineArgs, **config: Any) -> Iterator[ServerThread]:
    """OpenAIServer(ServerConfig(**CONFIG)) on an AsyncEngine of ENGINE_ARGS, served until the block ends."""
    srv = OpenAIServer(ServerConfig(**config), lambda: AsyncEngine(engine_args), shutdown_timeout=5)
    with ServerThread(srv) as s:
        yield s


def until_idle(read_metrics: Callable[[], dict[str, float]], seconds: float, poll: float) -> dict[str, float]:
    """The server's metrics (READ_METRICS, every POLL seconds) once nothing runs, waits or holds KV blocks, or
    after SECONDS: the caller's assertions then say what is left."""
    deadline = time.monotonic() + seconds
    while True:
        m = read_metrics()
        if (m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
                and m["octavo:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(poll)
