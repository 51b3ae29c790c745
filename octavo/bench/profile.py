"""Where an engine step's time goes: schedule, pack (ModelRunner.prepare), backend, sample, commit
(Scheduler.update_from_output: KV bookkeeping, block hashing, stop checks), detokenize (text, stop strings,
outputs) and the rest — per step, from the StepRecord the step fills (perf_counter laps).

`attach_profiler(engine)` registers a step listener: nothing is wrapped or patched, and an engine without
a profiler pays only the laps every step takes. Used by `octavo bench throughput --profile` and
benchmarks/compare_peers.py.

Engine overhead = 1 - backend / step: the share of a step in which the model is not running.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from octavo.runtime.step_record import PHASES as STEP_PHASES
from octavo.runtime.step_record import StepRecord

if TYPE_CHECKING:
    from octavo.runtime.engine import LLMEngine

PHASES = (*STEP_PHASES, "other")


@dataclass(slots=True)
class StepTimes:
    batch_size: int = 0
    num_tokens: int = 0
    schedule: float = 0.0
    pack: float = 0.0
    backend: float = 0.0
    sample: float = 0.0
    commit: float = 0.0
    detokenize: float = 0.0
    total: float = 0.0

    @property
    def decode_only(self) -> bool:
        return self.batch_size > 0 and self.num_tokens == self.batch_size

    @property
    def other(self) -> float:
        return max(0.0, self.total - sum(getattr(self, p) for p in STEP_PHASES))


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

    def __call__(self, record: StepRecord) -> None:
        """The step listener: one StepTimes per step that ran the model."""
        self.steps.append(StepTimes(batch_size=record.batch_size, num_tokens=record.num_tokens,
                                    total=record.duration_s,
                                    **{p: record.seconds.get(p, 0.0) for p in STEP_PHASES}))

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


def attach_profiler(engine: LLMEngine) -> StepProfile:
    """Start timing ENGINE's steps; returns the profile that fills up."""
    prof = StepProfile()
    engine.add_step_listener(prof)
    return prof
