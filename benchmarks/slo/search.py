"""The rate search: the largest Poisson arrival rate at which an engine meets the SLO.

Geometric steps from a start rate (x factor while the SLO holds, / factor while it does not) until one
rate meets it and another misses it, then bisection in log space between the highest rate that met it
and the lowest that missed it, until they are within `precision` of each other or the point budget is
spent. Capacity is the highest measured rate that met the SLO below every rate that missed it (a noisy
pass above a miss does not count). Rates below `min_rate` are not tried: their N requests would take
longer than a point may last; an engine that misses the SLO there has a capacity below the lowest rate
measured, and the result says so instead of inventing a number.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.slo.target import PointResult
from octavo.errors import InvalidRequestError

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class SearchPlan:
    start_rate: float  # requests/s of the first point
    min_rate: float = 0.0  # the lowest rate a point may be measured at (its duration is about N / rate)
    max_rate: float = math.inf
    max_points: int = 6
    factor: float = 2.0
    precision: float = 0.15  # stop once the lowest miss / the highest pass <= 1 + precision

    def __post_init__(self) -> None:
        if not (0 < self.start_rate and self.factor > 1 and self.max_points >= 1 and self.precision > 0):
            raise InvalidRequestError(f"a search needs a positive start rate, factor > 1 and >= 1 point: {self}")


@dataclass(slots=True)
class Capacity:
    points: list[PointResult] = field(default_factory=list)  # in the order measured
    best: PointResult | None = None  # the capacity point; None when no rate met the SLO
    lowest_miss: float | None = None  # the lowest rate that missed it (None: every rate met it)
    note: str = ""

    @property
    def rate(self) -> float | None:
        return self.best.rate if self.best is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "lowest_miss": self.lowest_miss, "note": self.note,
                "best": self.best.to_dict() if self.best is not None else None,
                "points": [p.to_dict() for p in self.points]}


def bracket(points: list[PointResult]) -> tuple[PointResult | None, float | None]:
    """(the highest rate that met the SLO below every miss, the lowest rate that missed it)."""
    misses = [p.rate for p in points if not p.meets_slo]
    hi = min(misses) if misses else None
    passes = [p for p in points if p.meets_slo and (hi is None or p.rate < hi)]
    return (max(passes, key=lambda p: p.rate) if passes else None), hi


def search(measure: Callable[[float], PointResult], plan: SearchPlan) -> Capacity:
    points: list[PointResult] = []

    def at(rate: float) -> PointResult:
        p = measure(rate)
        points.append(p)
        return p

    rate = plan.start_rate
    limit = "the point budget"
    while len(points) < plan.max_points:  # geometric steps until the SLO is both met and missed
        p = at(rate)
        lo, hi = bracket(points)
        if lo is not None and hi is not None:
            break
        rate = rate * plan.factor if p.meets_slo else rate / plan.factor
        if rate > plan.max_rate or rate < plan.min_rate:
            limit = (f"the highest rate allowed ({plan.max_rate:.4g})" if rate > plan.max_rate else
                     f"the lowest rate a point's time budget allows ({plan.min_rate:.4g})")
            break
    lo, hi = bracket(points)
    while lo is not None and hi is not None and len(points) < plan.max_points and hi / lo.rate > 1 + plan.precision:
        at(math.sqrt(lo.rate * hi))
        lo, hi = bracket(points)
    cap = Capacity(points, lo, hi)
    if lo is None:
        low = min(p.rate for p in points)
        cap.note = f"missed the SLO at every rate measured: capacity < {low:.4g} req/s (the search stopped at {limit})"
    elif hi is None:
        cap.note = (f"met the SLO at every rate measured: capacity >= {lo.rate:.4g} req/s "
                    f"(the search stopped at {limit})")
    else:
        cap.note = f"between {lo.rate:.4g} (met) and {hi:.4g} req/s (missed), {len(points)} points"
    return cap
