"""Where an engine step's time goes: schedule, pack (ModelRunner.prepare), backend, sample, detokenize,
and the rest (stop checks, block hashing, outputs, trace row) — per step, from perf_counter stamps.

`attach_profiler(engine)` wraps the engine's collaborators on that one engine instance (scheduler.schedule,
runner.prepare, runner.run, sampler, tokenizer.decode, step); nothing changes in the engine's code and
an engine without a profiler pays nothing. Used by `octavo bench throughput --profile` and
scripts/compare_peers.py.

Engine overhead = 1 - backend / step: the share of a step in which the model is not running.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("schedule", "pack", "backend", "sample", "detokenize", "other")


@dataclass(slots=True)
class StepTimes:
    batch_size: int = 0
    num_tokens: int = 0
    schedule: float = 0.0
    pack: float = 0.0
    backend: float = 0.0
    sample: float = 0.0
    detokenize: float = 0.0
    total: float = 0.0

    @property
    def decode_only(self) -> bool:
        return self.batch_size > 0 and self.num_tokens == self.batch_size

    @property
    def other(self) -> float:
        return max(0.0, self.total - self.schedule - self.pack - self.backend - self.sample - self.detokenize)


@dataclass(slots=True)
class PhaseSummary:
    label: str
    steps: int
    mean_batch: float
    seconds: dict[str, float]  # phase -> total seconds over these steps
    total: float

    @property
    def engine_overhead(self) -> float:
        return 1.0 - self.seconds["backend"] / self.total if self.total > 0 else 0.0


@dataclass(slots=True)
class StepProfile:
    steps: list[StepTimes] = field(default_factory=list)
    _current: StepTimes | None = None

    def add(self, phase: str, seconds: float) -> None:
        if self._current is not None:
            setattr(self._current, phase, getattr(self._current, phase) + seconds)

    def summary(self, label: str, keep: Callable[[StepTimes], bool] = lambda s: True) -> PhaseSummary:
        sel = [s for s in self.steps if keep(s)]
        secs = {p: sum(getattr(s, p) for s in sel) for p in PHASES}
        return PhaseSummary(label, len(sel), sum(s.batch_size for s in sel) / max(1, len(sel)), secs,
                            sum(s.total for s in sel))

    def summaries(self) -> list[PhaseSummary]:
        """All steps; decode-only steps; decode-only steps at (near) the largest batch seen."""
        out = [self.summary("all steps"), self.summary("decode-only steps", lambda s: s.decode_only)]
        decode = [s.batch_size for s in self.steps if s.decode_only]
        if decode:
            big = max(decode)
            out.append(self.summary(f"decode steps, batch >= {int(big * 0.9)}",
                                    lambda s: s.decode_only and s.batch_size >= int(big * 0.9)))
        return [s for s in out if s.steps]

    def table(self) -> str:
        lines = [f"{'steps':32s} {'n':>5s} {'batch':>6s} " + " ".join(f"{p:>14s}" for p in PHASES)
                 + f" {'step ms':>8s} {'overhead':>8s}"]
        for s in self.summaries():
            cells = " ".join(f"{s.seconds[p] / s.steps * 1e3:7.2f}ms {s.seconds[p] / s.total * 100:3.0f}%"
                             if s.total else f"{'-':>14s}" for p in PHASES)
            lines.append(f"{s.label:32s} {s.steps:5d} {s.mean_batch:6.1f} {cells} {s.total / s.steps * 1e3:8.2f} "
                         f"{s.engine_overhead * 100:7.1f}%")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"summaries": [{**asdict(s), "engine_overhead": s.engine_overhead} for s in self.summaries()]}


def _wrap(prof: StepProfile, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.add(phase, time.perf_counter() - t0)

    return timed


def attach_profiler(engine: Any) -> StepProfile:
    """Start timing ENGINE's steps (an octavo LLMEngine); returns the profile that fills up."""
    prof = StepProfile()
    schedule = engine.scheduler.schedule

    def timed_schedule() -> Any:
        t0 = time.perf_counter()
        out = schedule()
        if prof._current is not None:
            prof._current.schedule += time.perf_counter() - t0
            prof._current.batch_size = len(out.scheduled)
            prof._current.num_tokens = sum(out.scheduled.values())
        return out

    step = engine.step

    def timed_step() -> Any:
        prof._current = current = StepTimes()
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            current.total = time.perf_counter() - t0
            prof._current = None
            if current.batch_size:
                prof.steps.append(current)

    engine.scheduler.schedule = timed_schedule
    engine.runner.prepare = _wrap(prof, "pack", engine.runner.prepare)
    engine.runner.run = _wrap(prof, "backend", engine.runner.run)
    engine.sampler = _wrap(prof, "sample", engine.sampler)
    engine.tokenizer.decode = _wrap(prof, "detokenize", engine.tokenizer.decode)
    engine.step = timed_step
    return prof
