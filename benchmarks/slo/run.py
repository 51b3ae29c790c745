"""One engine's capacity: start its server, calibrate, search the rate, stop it.

Calibration: after two warm-up requests, one request of the workload's mean lengths alone on the idle
server; 1 / its latency is the rate at which one-at-a-time serving saturates, and the search starts at
`start_load` (2) times that: a batching engine usually meets the SLO there and the search goes up, a
naive one misses it and the search goes down (quickly: a missed point stops early). The k-th point of every engine gets the same requests (workload.point_requests(k)) and the same
arrival pattern. For the one-at-a-time engine (hf-naive) the workload is also run alone, request after
request, and its capacity below the measurable range is estimated by fifo_replay (marked as such).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.peers.online import free_port, server_process
from benchmarks.slo import fifo_replay
from benchmarks.slo.engines import EngineFactory
from benchmarks.slo.point import Server, measure_alone, measure_point
from benchmarks.slo.search import Capacity, SearchPlan, search
from benchmarks.slo.target import PointResult, Slo
from benchmarks.slo.workload import ChatShape, mean_request, point_requests
from octavo.bench.report import RequestResult
from octavo.bench.workloads import BenchRequest

log = logging.getLogger(__name__)
ALONE_POINT = 10_000  # point index of the requests run alone for the replay (ids no measured point uses)


@dataclass(slots=True, frozen=True)
class RunOptions:
    max_points: int = 6
    max_point_s: float = 600.0  # a point's arrivals span about N / rate seconds: rates below N / this are not tried
    start_rate: float | None = None  # None: start_load / the calibration request's latency
    start_load: float = 2.0
    factor: float = 2.0
    precision: float = 0.15
    stop_early: bool = True


@dataclass(slots=True)
class EngineResult:
    engine: str
    command: str = ""
    load_s: float = 0.0  # process start to /health 200
    alone_ttft_s: float = 0.0  # the calibration request (mean lengths) alone
    alone_e2e_s: float = 0.0
    start_rate: float = 0.0
    capacity: Capacity | None = None
    estimate: Capacity | None = None  # hf-naive only: the FIFO replay of its requests run alone
    replay_checks: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    error: str | None = None  # the engine could not be measured (the message says why)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "command": self.command, "load_s": self.load_s,
                "alone_ttft_s": self.alone_ttft_s, "alone_e2e_s": self.alone_e2e_s, "start_rate": self.start_rate,
                "capacity": self.capacity.to_dict() if self.capacity else None,
                "estimate": self.estimate.to_dict() if self.estimate else None,
                "replay_checks": self.replay_checks, "wall_s": self.wall_s, "error": self.error}


def _warm_up(ids: list[int]) -> list[BenchRequest]:
    return [BenchRequest(ids[:8], 4, True, "warm-up"), BenchRequest(ids[8:40], 8, True, "warm-up")]


def run_engine(name: str, make: EngineFactory, shape: ChatShape, ids: list[int], slo: Slo, opts: RunOptions, *,
               one_at_a_time: bool = False) -> EngineResult:
    """Start the engine's server, measure it (measure_server), stop it; an engine that fails says why."""
    t_start = time.perf_counter()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    res = EngineResult(name)
    try:
        spec = make(port)  # may convert the model first (vLLM's HF folder)
        res.engine, res.command = spec.name, " ".join(spec.argv)
        with server_process(spec.argv, url, timeout_s=spec.ready_timeout_s, env=spec.env):
            res.load_s = time.perf_counter() - t_start
            server = Server(url, asyncio.run(_model_id(url)), spec.busy_gauges)
            measure_server(res, server, shape, ids, slo, opts, one_at_a_time=one_at_a_time)
    except Exception as exc:  # noqa: BLE001 - one engine failing must not lose the others' results
        log.exception("%s failed", res.engine)
        res.error = f"{type(exc).__name__}: {exc}"[:800]
    res.wall_s = time.perf_counter() - t_start
    return res


def measure_server(res: EngineResult, server: Server, shape: ChatShape, ids: list[int], slo: Slo, opts: RunOptions,
                   *, one_at_a_time: bool = False) -> EngineResult:
    """Warm up, calibrate and search on a running server; fills RES (capacity, and the estimate when
    ONE_AT_A_TIME)."""
    asyncio.run(measure_alone(server, _warm_up(ids)))
    (cal,) = asyncio.run(measure_alone(server, [mean_request(shape, ids)]))
    res.alone_ttft_s, res.alone_e2e_s = cal.ttft, cal.latency
    res.start_rate = opts.start_rate or opts.start_load / cal.latency
    counter = iter(range(ALONE_POINT))

    def measure(rate: float) -> PointResult:
        k = next(counter)
        return asyncio.run(measure_point(server, point_requests(shape, k, ids), rate, slo, seed=shape.seed,
                                         stop_early=opts.stop_early))

    plan = SearchPlan(res.start_rate, min_rate=shape.num_requests / opts.max_point_s, max_points=opts.max_points,
                      factor=opts.factor, precision=opts.precision)
    res.capacity = search(measure, plan)
    if one_at_a_time:
        alone = asyncio.run(measure_alone(server, point_requests(shape, ALONE_POINT, ids)))
        _estimate(res, alone, slo, shape.seed)
    return res


def _estimate(res: EngineResult, alone: list[RequestResult], slo: Slo, seed: int) -> None:
    measured = res.capacity.points if res.capacity else []
    res.replay_checks = [fifo_replay.check(alone, p, slo, seed) for p in measured if p.sent == p.num_requests]
    start = min((p.rate for p in measured), default=res.start_rate)
    res.estimate = search(lambda r: fifo_replay.replay(alone, r, slo, seed),
                          SearchPlan(start, min_rate=start / 2 ** 30, max_points=80, precision=0.01))


async def _model_id(url: str) -> str:
    import aiohttp

    from octavo.bench.serve_client import served_model

    async with aiohttp.ClientSession() as session:
        return await served_model(session, url, None)
