"""`octavo serve` in its own process for the tests that need a real server: start it on a free port, wait for the
state "ready" (/health answers 200), stop it. One copy of the start/wait/stop the server tests shared."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


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
