"""The SLO and what one measured point (a rate, N requests) says about it.

A point meets the SLO when every request completed and the p-th percentile (numpy's linear
interpolation over the N requests) of TTFT and of TPOT are both within their limits. With N = 64 and
p = 99 the p99 lies between the largest and second-largest value: one slow request in 64 already
counts. A request that failed counts as infinitely slow on both.

`already_failed` lets a point stop early: once enough requests are over a limit, no later request can
bring the percentile back under it (the percentile's lower neighbour is already over).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from octavo.bench.report import RequestResult
from octavo.errors import InvalidRequestError


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float = 2.0  # limit on the percentile of time to first token
    tpot_s: float = 0.150  # limit on the percentile of time per output token after the first
    percentile: float = 99.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0 and 0 < self.percentile <= 100):
            raise InvalidRequestError(f"an SLO needs positive limits and a percentile in (0, 100]: {self}")

    def describe(self) -> str:
        p = f"p{self.percentile:g}"
        return f"{p} TTFT <= {self.ttft_s * 1000:g} ms and {p} TPOT <= {self.tpot_s * 1000:g} ms"

    def violations_to_fail(self, n: int) -> int:
        """How many of N values over a limit make the percentile exceed it whatever the others are."""
        return n - math.floor(self.percentile / 100.0 * (n - 1))


def ttft_of(r: RequestResult) -> float:
    return r.ttft if r.success else math.inf


def tpot_of(r: RequestResult) -> float:
    if not r.success:
        return math.inf
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0


def already_failed(done: list[RequestResult], n: int, slo: Slo) -> bool:
    """True when the requests finished so far settle that a point of N requests misses the SLO."""
    need = slo.violations_to_fail(n)
    return (sum(ttft_of(r) > slo.ttft_s for r in done) >= need
            or sum(tpot_of(r) > slo.tpot_s for r in done) >= need)


@dataclass(slots=True)
class PointResult:
    """One measured rate: N requests with Poisson arrivals; latencies in seconds."""

    rate: float  # requests/s offered
    num_requests: int  # the point's N
    completed: int = 0
    failed: int = 0
    sent: int = 0  # < N when the point stopped early
    stopped_early: bool = False  # enough requests were over a limit: the SLO is missed whatever came next
    duration_s: float = 0.0  # first arrival to the last request's end (or the early stop)
    ttft_p50: float = math.nan
    ttft_p99: float = math.nan  # at the SLO's percentile (named p99 for the default)
    tpot_p50: float = math.nan
    tpot_p99: float = math.nan
    e2e_mean: float = math.nan
    output_tokens: int = 0
    meets_slo: bool = False
    why: str = ""  # which limit was missed, or the first error
    estimated: bool = False  # True: computed by replaying measured service times (hf-naive below its range)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def users(self) -> float:
        """Requests in the system on average (Little's law: arrival rate x mean time in the system)."""
        return self.rate * self.e2e_mean if math.isfinite(self.e2e_mean) else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["users"] = self.users
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def judge(rate: float, results: list[RequestResult], n: int, slo: Slo, duration_s: float,
          stopped_early: bool = False, sent: int | None = None) -> PointResult:
    """The point's percentiles and its verdict. RESULTS: the requests that finished (all N unless the point
    stopped early; SENT, default len(RESULTS), counts those cancelled in flight too)."""
    ok = [r for r in results if r.success]
    p = PointResult(rate, n, completed=len(ok), failed=len(results) - len(ok),
                    sent=len(results) if sent is None else sent,
                    stopped_early=stopped_early, duration_s=duration_s, output_tokens=sum(r.output_len for r in ok))
    if ok:
        ttft = np.array([r.ttft for r in ok])
        tpot = np.array([tpot_of(r) for r in ok])
        p.ttft_p50, p.ttft_p99 = float(np.percentile(ttft, 50)), float(np.percentile(ttft, slo.percentile))
        p.tpot_p50, p.tpot_p99 = float(np.percentile(tpot, 50)), float(np.percentile(tpot, slo.percentile))
        p.e2e_mean = float(np.mean([r.latency for r in ok]))
    errors = [r.error for r in results if not r.success]
    if errors:
        p.why = f"{len(errors)} request(s) failed: {errors[0][:200]}"
    elif stopped_early or len(results) < n:
        p.why = "stopped early: " + _over(results, slo, n)
    elif p.ttft_p99 > slo.ttft_s or p.tpot_p99 > slo.tpot_s:
        p.why = _over(results, slo, n)
    else:
        p.meets_slo = True
    return p


def _over(results: list[RequestResult], slo: Slo, n: int) -> str:
    t = sum(ttft_of(r) > slo.ttft_s for r in results)
    o = sum(tpot_of(r) > slo.tpot_s for r in results)
    return (f"{t} of {n} requests over the TTFT limit, {o} over the TPOT limit "
            f"({slo.violations_to_fail(n)} settle it)")
