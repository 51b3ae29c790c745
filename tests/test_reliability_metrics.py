"""The server's finish counters tell the truth about aborts: a request whose client leaves before its first
token (it is still waiting behind others) is counted in request_success_total{finished_reason="abort"},
exactly once, like one that leaves mid-stream (only the second used to be counted). A refused request
(400) is not counted as an abort."""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest
from faulty_backend import FaultPlan, FaultyBackend
from toy_backend import ToyBackend, make_toy_model_dir

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.state import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer

NAME = "toy"


def scrape(url: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r'^(octavo:[a-z0-9_]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$', httpx.get(url + "/metrics").text, re.M):
        reason = re.search(r'finished_reason="([a-z]+)"', m.group(2) or "")
        out[m.group(1) + (f"[{reason.group(1)}]" if reason else "")] = float(m.group(3))
    return out


def _wait(url: str, cond, what: str, timeout: float = 60.0) -> dict[str, float]:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if cond(m):
            return m
        assert time.monotonic() < deadline, (what, m)
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = make_toy_model_dir(tmp_path_factory.mktemp("toy"))
    ea = EngineArgs(model=str(folder), block_size=4, num_blocks=256, max_num_seqs=1)
    backend = FaultyBackend(ToyBackend(256, 4), FaultPlan(delay_s=0.01))  # 10 ms steps: a long request lasts
    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), lambda: AsyncEngine(ea, backend), shutdown_timeout=2)
    with ServerThread(srv) as s:
        yield s


def test_abort_before_the_first_token_is_counted(server: ServerThread) -> None:
    url = server.base_url
    before = scrape(url)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            # one long request holds the only sequence slot; the second waits behind it, with no token yet
            long_req = asyncio.create_task(c.post("/v1/completions", json={
                "model": NAME, "prompt": [5, 6], "max_tokens": 900, "ignore_eos": True}))
            await asyncio.to_thread(_wait, url, lambda m: m["octavo:num_requests_running"] == 1, "the long one runs")
            waiting = asyncio.create_task(c.post("/v1/completions", json={
                "model": NAME, "prompt": [7, 8], "max_tokens": 4, "stream": True}))
            await asyncio.to_thread(_wait, url, lambda m: m["octavo:num_requests_waiting"] == 1, "the second waits")
            waiting.cancel()  # the client leaves before its first token
            await asyncio.to_thread(_wait, url, lambda m: m["octavo:num_requests_waiting"] == 0, "it is aborted")
            long_req.cancel()  # and the long one mid-generation
            await asyncio.gather(long_req, waiting, return_exceptions=True)

    asyncio.run(main())
    after = _wait(url, lambda m: m["octavo:num_requests_running"] == 0 and m["octavo:kv_cache_usage_perc"] == 0,
                  "the engine to be idle")
    # the counters are updated as the handlers end: wait for both aborts rather than for a time
    after = _wait(url, lambda m: m["octavo:request_success_total[abort]"] - before["octavo:request_success_total[abort]"] >= 2,
                  "two aborts counted", timeout=30)
    assert after["octavo:request_success_total[abort]"] - before["octavo:request_success_total[abort]"] == 2
    assert after["octavo:request_success_total[length]"] == before["octavo:request_success_total[length]"]
    assert after["octavo:e2e_request_latency_seconds_count"] - before["octavo:e2e_request_latency_seconds_count"] == 2


def test_refused_request_is_not_counted_as_an_abort(server: ServerThread) -> None:
    url = server.base_url
    before = scrape(url)
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": [5] * 5000, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    after = scrape(url)
    for reason in ("abort", "stop", "length"):
        key = f"octavo:request_success_total[{reason}]"
        assert after[key] == before[key], key
