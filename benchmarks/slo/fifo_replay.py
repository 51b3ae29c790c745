"""Naive serving's latencies at rates too low to measure in the time a point may take, from measured ones.

A server that runs one request at a time in arrival order is a single FIFO queue: request i starts when
it has arrived and request i-1 has finished, and then takes exactly as long as it takes alone. So with
each request's time to first token and end-to-end time measured alone (back to back, on the real
server), its TTFT and TPOT at any arrival pattern follow:

    start_i = max(arrive_i, end_{i-1});  TTFT_i = start_i - arrive_i + ttft_alone_i;  end_i = start_i + e2e_alone_i

The arrival pattern is the one the measured points use (point.arrival_offsets, same seed), so a replayed
rate is comparable with a measured one; `check` puts the replay beside a point measured for real.
Results are marked `estimated`; this is only valid for a strictly one-at-a-time server (hf-naive).
"""
from __future__ import annotations

import math

from benchmarks.slo.point import arrival_offsets
from benchmarks.slo.target import PointResult, Slo, judge
from octavo.bench.report import RequestResult


def replay(alone: list[RequestResult], rate: float, slo: Slo, seed: int = 0) -> PointResult:
    """The point at RATE that a one-at-a-time server would give, from its requests' times alone."""
    out: list[RequestResult] = []
    end = -math.inf
    arrivals = arrival_offsets(len(alone), rate, seed)
    for r, at in zip(alone, arrivals, strict=True):
        start = max(at, end)
        end = start + r.latency
        out.append(RequestResult(success=r.success, prompt_len=r.prompt_len, output_len=r.output_len,
                                 ttft=start - at + r.ttft, latency=end - at, error=r.error))
    point = judge(rate, out, len(alone), slo, duration_s=end)
    point.estimated = True
    return point


def check(alone: list[RequestResult], measured: PointResult, slo: Slo, seed: int = 0) -> dict[str, float]:
    """The replay at a measured point's rate beside that point's own percentiles (seconds)."""
    est = replay(alone, measured.rate, slo, seed)
    return {"rate": measured.rate, "measured_ttft_p99": measured.ttft_p99, "replayed_ttft_p99": est.ttft_p99,
            "measured_tpot_p99": measured.tpot_p99, "replayed_tpot_p99": est.tpot_p99}
