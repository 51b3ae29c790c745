"""Graceful shutdown of `octavo serve` (a real subprocess): SIGTERM stops new connections, gives in-flight
requests --shutdown-timeout seconds, then aborts what is left through the engine, so every open stream
still ends properly (a last chunk with a finish reason, then [DONE]), every non-streamed request gets
its response, and the process exits 0 within the bound: timeout + EXIT_SLACK seconds."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import serve_process
from engine_helpers import exported

EXIT_SLACK = 10.0  # seconds beyond --shutdown-timeout for the engine to stop and the process to exit


def start_serve(folder: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    return serve_process.start_serve([str(folder), "--port", "0", "--num-threads", "1",
                                      "--served-model-name", "tiny", *extra])


def in_engine(url: str) -> float:
    return in_engine_text(httpx.get(url + "/metrics").text)


def in_engine_text(text: str) -> float:
    vals = re.findall(r"^octavo:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in vals)


@pytest.fixture(scope="module")
def folder(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):  # noqa: ANN001, ANN201
    """The tiny llama with an 8192-token context: a request for ~8000 tokens takes seconds even when the
    tiny model's steps take a millisecond, so it is surely still running when a 1 s shutdown timeout ends."""
    from models import make_random_model

    from octavo.export import export_model

    root = tmp_path_factory.mktemp("long_context")
    src = make_random_model(root / "hf", "llama", max_position_embeddings=LONG_CONTEXT)
    export_model(src, root / "octavo", progress=False)
    return root / "octavo"


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


def test_sigterm_under_load_exits_cleanly_and_nobody_hangs(long_folder) -> None:  # noqa: ANN001
    """SIGTERM in the middle of 32 concurrent clients sending request after request (streams and whole,
    some long): the process exits 0 within timeout + EXIT_SLACK; every request that got in either finished
    or ended with finish_reason "abort" ([DONE] for streams); later ones are refused at connect; no client
    hangs, and no stream that had begun is cut."""
    import asyncio
    import random

    timeout = 1.0
    proc, url = start_serve(long_folder, "--num-blocks", "4200", "--max-num-seqs", "8", "--shutdown-timeout", str(timeout))
    outcomes: list[str] = []

    async def client(k: int, stop_at: float) -> None:
        rng = random.Random(k)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            while time.monotonic() < stop_at:
                body = {"prompt": [rng.randrange(5, 380) for _ in range(rng.randrange(1, 40))],
                        "max_tokens": rng.choice([4, 16, 4, 16, LONG_CONTEXT - 64]), "ignore_eos": True}
                lines: list[str] = []
                try:
                    if rng.random() < 0.5:
                        r = await c.post("/v1/completions", json=body)
                        assert r.status_code in (200, 503), r.text  # 503: arrived while draining
                        outcomes.append(r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else "503")
                    else:
                        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            async for ln in r.aiter_lines():
                                if ln.startswith("data: "):
                                    lines.append(ln)
                            if r.status_code == 503:
                                outcomes.append("503")
                                continue
                            assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines[-2:]
                            outcomes.append(json.loads(lines[-2][6:])["choices"][0]["finish_reason"])
                except httpx.TransportError as exc:  # the listener closed, or an idle keep-alive connection
                    # was closed as this request went out: fine, unless a stream had already begun
                    outcomes.append("cut stream" if lines else type(exc).__name__)
                    return

    async def main() -> float:
        stop_at = time.monotonic() + 600  # the clients run until the server refuses them (bounded below)
        tasks = [asyncio.create_task(client(k, stop_at)) for k in range(32)]
        # the state the assertions need, never a time: requests completed (some "length") and requests still
        # in the engine (long ones, which the drain's timeout must abort)
        deadline = time.monotonic() + 300
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            while not (outcomes.count("length") > 10 and in_engine_text((await c.get("/metrics")).text) > 0):
                assert time.monotonic() < deadline, outcomes
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout + EXIT_SLACK + 30)
        return t0

    try:
        t0 = asyncio.run(main())
        code = proc.wait(timeout + EXIT_SLACK)
        assert code == 0 and time.monotonic() - t0 <= timeout + EXIT_SLACK + 30
        counts = {k: outcomes.count(k) for k in set(outcomes)}
        print("outcomes:", counts)
        assert counts.get("length", 0) > 10 and counts.get("abort", 0) >= 1, counts
        assert "cut stream" not in counts, counts
        assert set(counts) <= {"length", "abort", "503", "ConnectError", "RemoteProtocolError", "ReadError"}, counts
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def in_flight(url: str) -> float:
    m = re.search(r"^octavo:http_requests_in_flight\{[^}]*\} ([0-9.e+]+)$", httpx.get(url + "/metrics").text, re.M)
    assert m, "no octavo:http_requests_in_flight gauge"
    return float(m.group(1))


def test_a_body_that_never_ends_does_not_hold_shutdown(folder) -> None:  # noqa: ANN001
    """A client trickles a chunked body for ever (under every size and body-time limit). SIGTERM must still
    end the process within --shutdown-timeout + EXIT_SLACK, and that client gets a proper 503 shutting_down
    (it used to wait for the drain, then again for aiohttp's own shutdown timeout, and was cut without an
    answer: about twice the documented bound)."""
    import socket

    timeout = 1.0
    proc, url = start_serve(folder, "--num-blocks", "16", "--shutdown-timeout", str(timeout), "--body-timeout", "600")
    host, port = url.removeprefix("http://").split(":")
    stop = threading.Event()
    try:
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + b"2\r\n[ \r\n")

        def trickle() -> None:
            while not stop.is_set():
                try:
                    sock.sendall(b"1\r\n \r\n")
                except OSError:
                    return
                stop.wait(0.05)

        threading.Thread(target=trickle, daemon=True).start()
        deadline = time.monotonic() + 60
        while in_flight(url) < 2:  # our request's handler runs (the scrape itself is the other one)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        resp = b""
        while b"\r\n\r\n" not in resp or len(resp.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"Content-Length: (\d+)", resp).group(1) if re.search(rb"Content-Length: (\d+)", resp) else 1):
            chunk = sock.recv(65536)
            if not chunk:
                break
            resp += chunk
        code = proc.wait(timeout + EXIT_SLACK)
        elapsed = time.monotonic() - t0
        assert code == 0, proc.stdout.read()
        assert elapsed <= timeout + EXIT_SLACK, elapsed
        head, _, body = resp.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), resp[:500]
        assert json.loads(body)["error"]["code"] == "shutting_down"
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
