"""`octavo bench serve`: an async HTTP client that replays a workload against /v1/completions (streaming).

Requests start at Poisson arrival times (--request-rate R per second; inf = all at once), at most
--max-concurrency in flight. Each request streams with stream_options.include_usage, so token counts
come from the server's own usage record; timings are taken here, on the client's clock.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from octavo.bench.report import RequestResult
from octavo.bench.workloads import BenchRequest


@dataclass(slots=True)
class ServeBenchConfig:
    base_url: str
    model: str | None = None  # default: the first model of GET /v1/models
    api_key: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    timeout_s: float = 6 * 3600.0


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def sse_objects(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an OpenAI server-sent-event stream (aiohttp response), up to `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def served_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    async with session.get(f"{base_url}/v1/models", headers=_headers(api_key)) as resp:
        body = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models answered {resp.status}: {body}")
        return body["data"][0]["id"]


async def send_one(session: aiohttp.ClientSession, cfg: ServeBenchConfig, model: str, req: BenchRequest) -> RequestResult:
    payload: dict[str, Any] = {
        "model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": cfg.temperature,
        "ignore_eos": req.ignore_eos, "stream": True, "stream_options": {"include_usage": True},
    }
    res = RequestResult()
    texts: list[str] = []
    chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{cfg.base_url}/v1/completions", json=payload, headers=_headers(cfg.api_key)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return res
            async for obj in sse_objects(resp):
                if "error" in obj:
                    res.error = obj["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                for ch in obj.get("choices") or []:
                    if ch.get("text"):
                        texts.append(ch["text"])
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        chunks += 1
                        last = now
                if obj.get("usage"):
                    res.prompt_len = obj["usage"]["prompt_tokens"]
                    res.output_len = obj["usage"]["completion_tokens"]
        res.latency = last - start if chunks else time.perf_counter() - start
        res.generated_text = "".join(texts)
        if not res.output_len:
            res.output_len = chunks  # a server without usage in streams: count chunks
        res.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_serve_bench(cfg: ServeBenchConfig, requests: list[BenchRequest]) -> tuple[list[RequestResult], float, str]:
    """Replay REQUESTS; returns (results in workload order, wall-clock duration, model name)."""
    rng = random.Random(cfg.seed)
    limit = cfg.max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    conn = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        model = cfg.model or await served_model(session, cfg.base_url, cfg.api_key)

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                return await send_one(session, cfg, model, req)

        tasks = []
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(cfg.request_rate) and cfg.request_rate > 0 and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))  # Poisson process
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration, model
