"""Everything one trace says, gathered once: rows, per-request spans, memory report, optional labels and
answers; and its terminal rendering (table, per-step log, timeline, memory, answers)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from octavo.tracing.memory import MemoryReport, format_memory_report, memory_report
from octavo.tracing.spans import RequestSpan, build_spans, format_table
from octavo.tracing.steplog import format_step_log
from octavo.tracing.timeline import label_of, render_timeline


@dataclass(slots=True)
class TraceReport:
    rows: list[dict[str, Any]]
    spans: list[RequestSpan]
    memory: MemoryReport
    title: str = ""
    labels: dict[str, str] = field(default_factory=dict)  # request id -> kind ("Short answer", ...)
    answers: dict[str, str] = field(default_factory=dict)  # request id -> generated text
    notes: list[str] = field(default_factory=list)  # lines shown under the title


def build_report(
    rows: list[dict[str, Any]],
    *,
    title: str = "",
    labels: dict[str, str] | None = None,
    answers: dict[str, str] | None = None,
    notes: list[str] | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    bytes_per_slot: int | None = None,
) -> TraceReport:
    """Rows must be validated (reader.read_trace / reader.check_rows) and non-empty."""
    spans = build_spans(rows)
    mem = memory_report(rows, spans, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        bytes_per_slot=bytes_per_slot)
    return TraceReport(rows, spans, mem, title, dict(labels or {}), dict(answers or {}), list(notes or []))


def summary_line(report: TraceReport) -> str:
    rows = report.rows
    secs = sum(r["duration_s"] for r in rows)
    generated = sum(s.output_len for s in report.spans)
    text = (
        f"{len(report.spans)} requests, {len(rows)} steps, {sum(r['num_tokens'] for r in rows)} tokens computed "
        f"({generated} generated), max batch {max(r['batch_size'] for r in rows)}, "
        f"{sum(len(r['preempted']) for r in rows)} preemptions"
    )
    if secs > 0:
        text += f", {secs:.2f} s in steps ({generated / secs:.1f} generated tok/s)"
    return text


def static_batching_line(report: TraceReport) -> str:
    """When all arrived together and finished: mean steps to finish here vs under static batching."""
    spans = report.spans
    if not spans or len({s.arrived_step for s in spans}) != 1 or any(s.finished_step is None for s in spans):
        return ""
    start = spans[0].arrived_step
    waits = [s.finished_step - start + 1 for s in spans]  # type: ignore[operator]
    longest = max(waits)
    return (
        f"Each request left as soon as it was done: on average after {sum(waits) / len(waits):.1f} steps. Static "
        f"batching would hold every one of them for all {longest} steps of the longest, with its KV reserved."
    )


def format_answers(report: TraceReport, max_lines: int = 12) -> str:
    """Each answer under its label, indented, newlines kept (code stays readable)."""
    out = []
    for span in report.spans:
        if span.id not in report.answers:
            continue
        kind = report.labels.get(span.id, "")
        out.append(" ".join(filter(None, [label_of(span.id), kind, f"[{span.output_len} tok]"])))
        lines = report.answers[span.id].strip().splitlines() or [""]
        if len(lines) > max_lines:
            lines = lines[:max_lines] + [f"… ({len(lines) - max_lines} more lines)"]
        out += ["    " + ln for ln in lines]
    return "\n".join(out)


def section(title: str) -> str:
    return f"\n=== {title} " + "=" * max(3, 96 - len(title))


def format_terminal(report: TraceReport, *, step_log: bool = True, answers: bool = True) -> str:
    parts = []
    if report.title:
        parts.append(report.title)
    parts += report.notes
    parts.append(summary_line(report))
    parts += [section("Requests"), format_table(report.spans, report.labels)]
    static = static_batching_line(report)
    if static:
        parts.append(static)
    if step_log:
        parts += [section("Per-step log"), format_step_log(report.rows)]
    parts += [section("Timeline"), render_timeline(report.rows, report.spans)]
    parts += [section("KV memory, measured"), format_memory_report(report.memory)]
    if answers and report.answers:
        parts += [section("Answers"), format_answers(report)]
    return "\n".join(parts)
