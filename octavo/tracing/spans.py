"""From step rows to per-request lifetimes: when each request arrived, ran, was preempted and finished."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from octavo.tracing.textgrid import grid

# what a request did in one step (one cell of the timeline)
WAITING = "waiting"  # arrived, not scheduled this step (queued, or waiting to be recomputed)
PREFILL = "prefill"
DECODE = "decode"
PREEMPTED = "preempted"  # its blocks were taken back this step


@dataclass(slots=True)
class RequestSpan:
    id: str
    arrived_step: int  # first step after it was added (the row that lists it in "arrived")
    first_step: int | None = None  # first step it was scheduled in
    finished_step: int | None = None
    finish_reason: str | None = None
    prompt_len: int = 0
    output_len: int = 0  # generated tokens at the end of the trace
    total_len: int = 0  # tokens in its KV cache at its last scheduled step
    max_blocks: int = 0
    cached: int = 0  # prompt tokens served from the prefix cache
    prefill_steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    states: dict[int, str] = field(default_factory=dict)  # step -> WAITING | PREFILL | DECODE | PREEMPTED
    last_blocks: int = 0  # blocks held at its last scheduled step
    last_step: int = 0  # last step it appears in (scheduled, preempted or finished)

    @property
    def total(self) -> int:
        """prompt + generated tokens (the seed's "Total" column)."""
        return self.prompt_len + self.output_len


def build_spans(rows: list[dict[str, Any]]) -> list[RequestSpan]:
    """Per-request lifetimes from validated rows, ordered by arrival step, then first appearance."""
    spans: dict[str, RequestSpan] = {}

    def get(rid: str, step: int) -> RequestSpan:
        if rid not in spans:
            spans[rid] = RequestSpan(id=rid, arrived_step=step)
        return spans[rid]

    for row in rows:
        step = row["step"]
        for rid in row["arrived"]:
            get(rid, step)
        for req in row["requests"]:
            span = get(req["id"], step)
            if span.first_step is None:
                span.first_step = step
            span.states[step] = req["phase"]
            if req["phase"] == PREFILL:
                span.prefill_steps += 1
            else:
                span.decode_steps += 1
            span.prompt_len = req["prompt_len"]
            span.output_len = max(span.output_len, req["output_len"])
            span.total_len = req["total_len"]
            span.max_blocks = max(span.max_blocks, req["blocks"])
            span.last_blocks = req["blocks"]
            span.cached = max(span.cached, req["cached"])
            span.last_step = step
        for rid in row["preempted"]:
            span = get(rid, step)
            span.states[step] = PREEMPTED
            span.preemptions += 1
            span.last_step = step
        for fin in row["finished"]:
            span = get(fin["id"], step)
            span.finished_step = step
            span.finish_reason = fin["reason"]
            span.last_step = step
    last = rows[-1]["step"] if rows else 0
    for span in spans.values():  # steps between arrival and the end where it was not scheduled
        end = span.finished_step if span.finished_step is not None else last
        for step in range(span.arrived_step, end + 1):
            span.states.setdefault(step, WAITING)
    order = {rid: i for i, rid in enumerate(spans)}
    return sorted(spans.values(), key=lambda s: (s.arrived_step, order[s.id]))


def format_table(spans: list[RequestSpan], labels: dict[str, str] | None = None) -> str:
    """The seed's table: seq, type, prompt, generated, total, finished at step (plus arrival if staggered)."""
    labels = labels or {}
    staggered = len({s.arrived_step for s in spans}) > 1
    head = ["seq"] + (["type"] if labels else []) + ["prompt", "generated", "total"]
    head += (["arrived"] if staggered else []) + ["finished at step"]
    body = []
    for s in spans:
        cells = [s.id] + ([labels.get(s.id, "")] if labels else [])
        cells += [f"{s.prompt_len} tok", f"{s.output_len} tok", f"{s.total} total"]
        cells += ([f"step {s.arrived_step}"] if staggered else [])
        if s.finished_step is None:
            cells.append("(running at end of trace)")
        else:
            reason = "" if s.finish_reason in ("length", "stop") else f" ({s.finish_reason})"
            cells.append(f"step {s.finished_step}{reason}")
        body.append(cells)
    return grid(head, body, right={2, 3, 4} if labels else {1, 2, 3})

