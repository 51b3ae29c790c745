"""Measure one point: N requests with Poisson arrivals at RATE against a running server, client-side.

Each request streams from /v1/completions through `octavo bench serve`'s client (serve_client.send_one:
TTFT = first streamed text, TPOT = (E2E - TTFT) / (tokens - 1) with the server's own usage count).
Arrival times are absolute offsets from the start (exponential gaps, seeded), so a slow event loop
does not stretch the schedule. The point stops early once the requests finished so far settle that
the SLO is missed (target.already_failed): the rest are not sent and those in flight are cancelled
(the client disconnects; every engine here aborts a disconnected stream). Before a point starts,
and after one that stopped early, the server is waited on until its own gauges say it is idle.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.slo.target import PointResult, Slo, already_failed, judge
from octavo.bench.report import RequestResult
from octavo.bench.serve_client import ServeBenchConfig, send_one
from octavo.bench.workloads import BenchRequest

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Server:
    """A running OpenAI-compatible server and how to tell that it is idle."""

    base_url: str
    model: str
    busy_gauges: tuple[str, ...]  # Prometheus gauges on /metrics whose sum is the requests it still holds


def _session(cfg: ServeBenchConfig) -> aiohttp.ClientSession:
    """A connection per request (no keep-alive): llama-server closes an idle kept-alive connection, and a
    request sent on it fails with "Can not write request body" (seen in compare_peers' online runs too)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=cfg.timeout_s))


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of N requests is sent: a Poisson process of RATE per second.
    The same seed gives the same pattern at every rate, scaled by 1 / rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def busy(session: aiohttp.ClientSession, server: Server) -> float:
    """Sum of the server's busy gauges (requests running or waiting) from its /metrics."""
    async with session.get(f"{server.base_url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in server.busy_gauges:
            rest = line[line.rindex("}") + 1:] if "}" in line else line[len(name):]
            total += float(rest.split()[0])  # the value after the name and labels (a timestamp may follow)
    return total


async def wait_idle(session: aiohttp.ClientSession, server: Server, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await busy(session, server) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.base_url} still busy after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def measure_point(server: Server, requests: list[BenchRequest], rate: float, slo: Slo, *, seed: int = 0,
                        stop_early: bool = True) -> PointResult:
    n = len(requests)
    cfg = ServeBenchConfig(base_url=server.base_url, model=server.model, temperature=0.0)
    async with _session(cfg) as session:
        await wait_idle(session, server)
        done: list[RequestResult] = []
        settled = asyncio.Event()  # set when the SLO is missed whatever comes next

        async def one(req: BenchRequest) -> RequestResult:
            r = await send_one(session, cfg, server.model, req)
            done.append(r)
            if stop_early and already_failed(done, n, slo):
                settled.set()
            return r

        tasks: list[asyncio.Task[RequestResult]] = []
        t0 = time.perf_counter()
        for req, at in zip(requests, arrival_offsets(n, rate, seed), strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(settled.wait(), delay)
                except TimeoutError:
                    pass
            if settled.is_set():
                break
            tasks.append(asyncio.create_task(one(req)))
        stopper = asyncio.create_task(settled.wait())
        pending = set(tasks)
        while pending and not settled.is_set():
            _, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopper)
        stopper.cancel()
        duration = time.perf_counter() - t0
        early = settled.is_set() and (len(tasks) < n or bool(pending))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if early:
            await wait_idle(session, server)  # the cancelled requests are gone before the next point
    point = judge(rate, list(done), n, slo, duration, stopped_early=early, sent=len(tasks))
    log.info("rate %.4g/s: %s (%d/%d sent, %.1f s)", rate, "meets the SLO" if point.meets_slo else point.why,
             point.sent, n, duration)
    return point


async def measure_alone(server: Server, requests: list[BenchRequest]) -> list[RequestResult]:
    """Each request alone on the idle server, one after another (warm-up, the zero-load calibration, and
    the service times fifo_replay needs); a failed request raises."""
    cfg = ServeBenchConfig(base_url=server.base_url, model=server.model, temperature=0.0)
    out = []
    async with _session(cfg) as session:
        await wait_idle(session, server)
        for req in requests:
            r = await send_one(session, cfg, server.model, req)
            if not r.success:
                raise RuntimeError(f"{server.base_url}: a request alone on the server failed: {r.error}")
            out.append(r)
    return out
