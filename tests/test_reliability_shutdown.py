"""Graceful shutdown of `octavo serve` (a real subprocess): SIGTERM stops new connections, gives in-flight
requests --shutdown-timeout seconds, then aborts what is left through the engine, so every open stream
still ends properly (a last chunk with a finish reason, then [DONE]), every non-streamed request gets
its response, and the process exits 0 within the bound: timeout + EXIT_SLACK seconds."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_helpers import exported

EXIT_SLACK = 10.0  # seconds beyond --shutdown-timeout for the engine to stop and the process to exit


def start_serve(folder: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "octavo", "serve", str(folder), "--port", "0", "--num-threads", "1",
         "--served-model-name", "tiny", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    assert m, line
    url = m.group(1)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.05)


def in_engine(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    vals = re.findall(r"^octavo:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in vals)


@pytest.fixture(scope="module")
def folder(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


def test_sigterm_aborts_what_outlasts_the_timeout_cleanly(folder) -> None:  # noqa: ANN001
    timeout = 0.5
    proc, url = start_serve(folder, "--num-blocks", "256", "--max-num-seqs", "1", "--shutdown-timeout", str(timeout))
    results: dict[int, object] = {}
    started = threading.Event()

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        events.append(ln[6:])
                        started.set()
            results[i] = events
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            results[i] = exc

    def whole(i: int) -> None:
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True},
                           timeout=60)
            results[i] = r
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    try:
        threads = [threading.Thread(target=stream if i < 4 else whole, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.02)
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while in_engine(url) < 6:  # all six admitted or queued before the signal
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        with pytest.raises(httpx.TransportError):  # the listener is closed at once
            httpx.get(url + "/health", timeout=2)
        code = proc.wait(timeout + EXIT_SLACK)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert code == 0, proc.stdout.read()
        assert elapsed <= timeout + EXIT_SLACK
        reasons = []
        for i, res in sorted(results.items()):
            assert not isinstance(res, Exception), (i, res)
            if isinstance(res, httpx.Response):
                assert res.status_code == 200, res.text
                reasons.append(res.json()["choices"][0]["finish_reason"])
                continue
            assert res[-1] == "[DONE]", (i, res[-3:])  # a proper end, not a cut connection
            chunks = [json.loads(e) for e in res[:-1]]
            finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert len(finals) == 1, (i, finals)
            reasons.append(finals[0])
            assert chunks[-1]["usage"] is not None  # include_usage: the usage chunk still comes
        assert len(reasons) == 6 and set(reasons) <= {"length", "abort"}
        assert "abort" in reasons  # max_num_seqs 1 and 1000-token requests: some outlasted the timeout
        assert "shutting down" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_while_idle_exits_at_once(folder) -> None:  # noqa: ANN001
    proc, url = start_serve(folder, "--num-blocks", "16", "--shutdown-timeout", "30")
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(EXIT_SLACK) == 0
        assert time.monotonic() - t0 < EXIT_SLACK  # nothing in flight: no waiting for the 30 s timeout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
