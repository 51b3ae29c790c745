"""Clients that send a complete non-streamed request and leave at once: the server must notice and abort.

A non-streamed request writes nothing until it finishes, so the server learns that its client left only from
the connection itself. Each abandoning client sends a full POST /v1/completions asking for MAX_TOKENS tokens
and then either closes its raw socket 0-5 ms later, or (httpx) times out after 50 ms. They come in bursts
while the server is busy with ordinary requests, and some bursts arrive while the server's event loop is
stalled, so that connections close before their handler starts, while the body is read, while the prompt is
tokenized on a worker thread, or right after admission (the windows of aiohttp's web_protocol: a lost
connection cancels the task that runs the request handler, whichever of them it is in).

Steps are slowed to STEP_S, so an abandoned request would need MAX_TOKENS * STEP_S = 2 s to run out: a
"length" finish among them can only mean that the server ignored the disconnect (a client, even a starved
one, does not take 2 s to close). Checked through the engine's trace (every abandoned request the engine
admitted ends "abort") and /metrics (finish counters, nothing left running, every KV block free at once).
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_helpers import exported
from faulty_backend import FaultPlan, FaultyBackend

from octavo.export.manifest import Manifest
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.state import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer

NAME = "tiny"
MAX_TOKENS = 400  # abandoned requests ask for this many
STEP_S = 0.005
ROUNDS = 6
PER_ROUND = 16  # abandoning clients per burst (every 4th an httpx timeout, the rest raw hang-ups)
NORMAL_TOKENS = 4  # ordinary requests running beside them


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


def metrics(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(octavo:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$",
                                          httpx.get(base_url + "/metrics").text, re.M):
        reason = re.search(r'finished_reason="(\w+)"', labels or "")
        out[name + (f"[{reason.group(1)}]" if reason else "")] = float(value)
    return out


async def hang_up(host: str, port: int, body: dict, delay: float) -> None:
    """Send one complete request over a fresh connection, close it DELAY seconds later without reading."""
    _, writer = await asyncio.open_connection(host, port)
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    await writer.drain()
    if delay:
        await asyncio.sleep(delay)
    writer.close()


async def time_out(c: httpx.AsyncClient, body: dict, problems: list[str]) -> None:
    try:
        r = await c.post("/v1/completions", json=body, timeout=0.05)
        problems.append(f"a {MAX_TOKENS}-token request answered within 50 ms: {r.status_code} {r.text[:200]}")
    except httpx.TimeoutException:
        pass


def test_abandoned_non_streamed_requests_are_aborted_not_run_out(model_dir: Path) -> None:
    ea = EngineArgs(model=str(model_dir), num_blocks=256, block_size=16, max_num_seqs=32, num_threads=1)
    lock = threading.Lock()
    reasons: dict[str, str] = {}  # engine request id -> finish reason (from the step trace)
    max_tokens_of: dict[str, int] = {}

    def load() -> AsyncEngine:
        inner = OnnxRuntimeBackend(model_dir, Manifest.load(model_dir), 256, 16, num_threads=1)
        engine = AsyncEngine(ea, backend=FaultyBackend(inner, FaultPlan(delay_s=STEP_S)))

        def listen(rec) -> None:  # noqa: ANN001 - a StepRecord
            row = rec.trace_row()
            with lock:
                reasons.update((f["id"], f["reason"]) for f in row["finished"])

        engine.add_step_listener(listen)
        return engine

    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), load, shutdown_timeout=5)
    rng = random.Random(7)
    problems: list[str] = []
    normal_ids: list[str] = []
    with ServerThread(srv) as s:
        async def normal(c: httpx.AsyncClient) -> None:
            r = await c.post("/v1/completions", json={"model": NAME, "prompt": "Hello there", "max_tokens": NORMAL_TOKENS,
                                                      "ignore_eos": True, "temperature": 0})
            d = r.json()
            normal_ids.append(d["id"])
            if d["choices"][0]["finish_reason"] != "length":
                problems.append(f"ordinary request: {d}")

        async def main() -> None:
            async with httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
                for rnd in range(ROUNDS):
                    if rnd % 2:  # the server's loop stalls while the burst connects, sends and leaves
                        s._loop.call_soon_threadsafe(time.sleep, 0.2)
                    jobs = [normal(c) for _ in range(4)]
                    for i in range(PER_ROUND):
                        prompt = [rng.randrange(5, 380) for _ in range(rng.randrange(1, 81))]
                        body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                "temperature": 0}
                        if i % 4 == 3:
                            jobs.append(time_out(c, body, problems))
                        else:
                            jobs.append(hang_up(s.host, s.port, body, rng.choice((0.0, 0.0, 0.001, 0.003, 0.005))))
                    await asyncio.gather(*jobs)

        t0 = time.monotonic()
        asyncio.run(main())
        # every abandoned request was aborted within a step or two of its close: the server is idle almost at once
        deadline = time.monotonic() + 30
        while True:
            m = metrics(s.base_url)
            idle = (m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
                    and m["octavo:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        idle_after = time.monotonic() - t0
        with lock:
            finished = dict(reasons)

    assert not problems, problems[:5]
    normal = set(normal_ids)
    abandoned = {rid: why for rid, why in finished.items() if rid not in normal}
    ran_out = sorted(rid for rid, why in abandoned.items() if why != "abort")
    assert not ran_out, f"{len(ran_out)} abandoned requests were not aborted: {[(r, abandoned[r]) for r in ran_out[:10]]}"
    assert idle, m
    assert m["octavo:request_success_total[length]"] == len(normal_ids), m  # only the ordinary ones ran out
    assert m["octavo:request_success_total[abort]"] <= len(abandoned)  # admitted ones that produced output
    # all of it took far less than running even one abandoned request out (MAX_TOKENS * STEP_S = 2 s) per round
    assert idle_after < ROUNDS * MAX_TOKENS * STEP_S, idle_after
