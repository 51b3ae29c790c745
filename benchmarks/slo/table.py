"""The SLO-capacity table: per engine the capacity rate, users at the SLO, its latencies there, and the
ratio to HF naive serving.

Capacity is shown as measured ("0.85": met there, missed above), as a bound when the search did not
bracket it ("< 0.15": missed at the lowest rate measured; ">= 3.2": met at the highest rate measured), or
for hf-naive below its measurable range as the FIFO replay of its measured service times ("~0.004").
Ratios carry the same qualifier. Users at SLO = Little's law at the capacity point: rate x mean
end-to-end latency, the requests in the system on average.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.slo.run import EngineResult
from benchmarks.slo.target import PointResult


@dataclass(slots=True)
class Row:
    engine: str
    rate: float | None  # the capacity, or the bound
    qualifier: str  # "" measured, "<" or ">=" a bound, "~" estimated by replay
    point: PointResult | None  # where the latencies come from
    how: str

    @property
    def users(self) -> float | None:
        return self.point.users if self.point is not None and self.qualifier != "<" else None


def row_of(r: EngineResult) -> Row:
    if r.error is not None or r.capacity is None:
        return Row(r.engine, None, "", None, f"not measured: {r.error}")
    cap = r.capacity
    if cap.best is not None:
        return Row(r.engine, cap.best.rate, "" if cap.lowest_miss is not None else ">=", cap.best, cap.note)
    if r.estimate is not None and r.estimate.best is not None:
        return Row(r.engine, r.estimate.best.rate, "~", r.estimate.best,
                   f"{cap.note}; ~ = FIFO replay of its {r.estimate.best.num_requests} requests' measured "
                   f"times alone")
    low = min(p.rate for p in cap.points)
    return Row(r.engine, low, "<", None, cap.note)


def ratio(row: Row, naive: Row | None) -> str:
    if row.rate is None or naive is None or naive.rate is None or row is naive:
        return "1.00x" if row is naive and row.rate is not None else "-"
    value = row.rate / naive.rate
    # the ratio is a bound whenever either side is one; an estimate on either side makes it an estimate
    if row.qualifier in ("<", ">=") or naive.qualifier in ("<", ">="):
        lower = row.qualifier == ">=" or naive.qualifier == "<"
        upper = row.qualifier == "<" or naive.qualifier == ">="
        if lower and upper:
            return "?"
        return (">= " if lower else "< ") + f"{value:.2f}x"
    return ("~" if "~" in (row.qualifier, naive.qualifier) else "") + f"{value:.2f}x"


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}" if x is not None and math.isfinite(x) else "-"


def format_table(results: list[EngineResult], naive_engine: str | None) -> str:
    rows = [row_of(r) for r in results]
    naive = next((row for row in rows if row.engine == naive_engine), None)
    lines = ["| engine | capacity (req/s) | users at SLO | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
             "x HF naive | how the search ended |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        p = row.point
        rate = f"{row.qualifier}{row.rate:.3g}" if row.rate is not None else "-"
        users = f"{'~' if row.qualifier == '~' else ''}{row.users:.2f}" if row.users is not None else "-"
        ttft = f"{_ms(p.ttft_p50)} / {_ms(p.ttft_p99)}" if p else "-"
        tpot = f"{_ms(p.tpot_p50)} / {_ms(p.tpot_p99)}" if p else "-"
        lines.append(f"| {row.engine} | {rate} | {users} | {ttft} | {tpot} | {ratio(row, naive)} | {row.how} |")
    return "\n".join(lines)
