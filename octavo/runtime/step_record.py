"""StepRecord: what one engine step did, filled by the step and read by every observer.

Step listeners (`LLMEngine.add_step_listener`), the JSONL trace (`EngineArgs.trace_path`), the profiler
(octavo/bench/profile.py) and Triton's metrics all read this one record: nothing wraps or patches the
engine. Filling it costs a few list appends per step; the JSON trace row is built only by whoever asks
for it (`trace_row`, which reads the requests' current state: call it inside the listener).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from time import time as wall_clock
from typing import TYPE_CHECKING, Any

from octavo.runtime.request import Request

if TYPE_CHECKING:
    from octavo.runtime.block_manager import BlockManager
    from octavo.runtime.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# the step's phases, in order: the scheduler's decision, packing the inputs (ModelRunner.prepare), the
# backend, sampling, the commit (Scheduler.update_from_output) and detokenization + outputs
PHASES = ("schedule", "pack", "backend", "sample", "commit", "detokenize")


@dataclass(slots=True)
class StepRecord:
    step: int
    time: float = field(default_factory=wall_clock)  # wall clock at the start
    scheduled: dict[Request, int] = field(default_factory=dict)  # request -> tokens computed, packing order
    starts: list[int] = field(default_factory=list)  # per scheduled request: its computed tokens before the step
    blocks: list[int] = field(default_factory=list)  # per scheduled request: its block-table length in the step
    preempted: list[Request] = field(default_factory=list)
    held: list[Request] = field(default_factory=list)  # waiting for a prefix block another request is computing
    arrived: list[str] = field(default_factory=list)  # sequence ids added since the previous step
    finished: list[Request] = field(default_factory=list)  # ended since the previous step (any reason)
    num_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    drafts: dict[Request, tuple[int, int]] = field(default_factory=dict)  # speculation: (draft tokens, accepted)
    error: str | None = None  # the backend/sampler failure that ended this step's requests
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds (PHASES)
    duration_s: float = 0.0
    _t: float = field(default_factory=perf_counter)

    def capture(self, scheduled: dict[Request, int]) -> None:
        """Before the commit: where each scheduled request starts and how many blocks it holds."""
        self.starts = [r.num_computed_tokens for r in scheduled]
        self.blocks = [len(r.block_table) for r in scheduled]

    def speculated(self, sampled: list[Request], token_ids: list[list[int]]) -> None:
        """Before the commit: per request that had draft tokens, how many, and how many were accepted."""
        for req, toks in zip(sampled, token_ids):
            if req.spec_token_ids:
                self.drafts[req] = (len(req.spec_token_ids), len(toks) - 1)

    def end(self, sched: SchedulerOutput, arrived: list[str], finished: list[Request], num_waiting: int,
            bm: BlockManager) -> None:
        """After the step: what the scheduler decided, who arrived and finished, the queue and the pool."""
        self.scheduled, self.preempted, self.held = sched.scheduled, sched.preempted, sched.held
        self.arrived, self.finished, self.num_waiting = arrived, finished, num_waiting
        self.free_blocks, self.total_blocks, self.block_size = bm.num_free_blocks, bm.num_blocks, bm.block_size

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap (or the start) to PHASE."""
        now = perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._t
        self.duration_s += now - self._t
        self._t = now

    @property
    def batch_size(self) -> int:
        return len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())

    def trace_row(self) -> dict[str, Any]:
        """The step as one JSON-able trace row (the format octavo/tracing reads)."""
        reqs = [{"id": r.request_id, "phase": _phase(r, n, start, r in self.drafts),
                 "tokens": n, "prompt_len": r.num_prompt_tokens, "total_len": start + n,
                 "output_len": r.num_output_tokens, "blocks": blocks, "cached": r.metrics.num_cached_tokens}
                for (r, n), start, blocks in zip(self.scheduled.items(), self.starts, self.blocks)]
        for row, r in zip(reqs, self.scheduled):
            if r in self.drafts:  # speculative decoding: drafts verified this step, and how many were accepted
                row["draft_tokens"], row["accepted_tokens"] = self.drafts[r]
        return {
            "step": self.step, "time": self.time, "duration_s": self.duration_s, "batch_size": self.batch_size,
            "num_tokens": self.num_tokens, "num_waiting": self.num_waiting, "free_blocks": self.free_blocks,
            "total_blocks": self.total_blocks, "block_size": self.block_size, "requests": reqs,
            "arrived": self.arrived, "finished": [{"id": r.request_id, "reason": r.finish_reason} for r in self.finished],
            "preempted": [r.request_id for r in self.preempted], "held": [r.request_id for r in self.held],
        }


def _phase(r: Request, n: int, start: int, drafted: bool) -> str:
    return "decode" if (n == 1 or drafted) and start >= r.num_prompt_tokens else "prefill"


StepListener = Callable[[StepRecord], None]


def notify(listeners: list[StepListener], rec: StepRecord) -> None:
    """Hand REC to every listener (on the engine's thread); a broken listener must not stop the engine."""
    for fn in listeners:
        try:
            fn(rec)
        except Exception:  # noqa: BLE001
            logger.exception("step listener %r failed", fn)
