"""The trace as one self-contained HTML page: the PNG embedded as base64, the ASCII timeline, the
request table, the memory report and the per-step log as tables. No scripts, no external resources."""
from __future__ import annotations

import base64
import html
from pathlib import Path

from octavo.tracing.memory import format_memory_report
from octavo.tracing.report import TraceReport, summary_line
from octavo.tracing.timeline import label_of, render_timeline

STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; }
pre { background: #fafafa; border: 1px solid #eee; padding: 0.8em; overflow-x: auto; font-size: 0.85em;
      line-height: 1.2; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #555; } td.pre { white-space: pre-wrap; font-family: ui-monospace, monospace; }
"""


def _table(head: list[str], body: list[list[object]], left: set[int] = frozenset(), pre: set[int] = frozenset()) -> str:
    cls = lambda i: ' class="l pre"' if i in pre else ' class="l"' if i in left else ""  # noqa: E731
    th = "".join(f"<th{cls(i)}>{html.escape(h)}</th>" for i, h in enumerate(head))
    trs = "".join(
        "<tr>" + "".join(f"<td{cls(i)}>{html.escape(str(c))}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in body
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def render_html(report: TraceReport, png: bytes | None = None) -> str:
    esc = html.escape
    title = report.title or "octavo trace"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        *(f'<p class="note">{esc(n)}</p>' for n in report.notes),
        f"<p>{esc(summary_line(report))}</p>",
    ]
    if png:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<img alt="timeline, batch size, KV blocks and tokens per step" src="data:image/png;base64,{data}">')
    parts.append("<h2>Requests</h2>")
    body = []
    for s in report.spans:
        finished = f"step {s.finished_step}" if s.finished_step is not None else "running"
        body.append([label_of(s.id), report.labels.get(s.id, ""), s.prompt_len, s.output_len, s.total,
                     s.arrived_step, s.first_step or "", finished, s.finish_reason or "", s.preemptions])
    parts.append(_table(["seq", "type", "prompt", "generated", "total", "arrived", "first scheduled",
                         "finished at", "reason", "preemptions"], body, left={0, 1, 8}))
    parts += ["<h2>Timeline</h2>", f"<pre>{esc(render_timeline(report.rows, report.spans))}</pre>"]
    parts += ["<h2>KV memory, measured</h2>", f"<pre>{esc(format_memory_report(report.memory))}</pre>"]
    if report.answers:
        parts.append("<h2>Answers</h2>")
        body = [[label_of(s.id), report.labels.get(s.id, ""), report.answers[s.id]]
                for s in report.spans if s.id in report.answers]
        parts.append(_table(["seq", "type", "text"], body, left={0, 1}, pre={2}))
    parts.append("<h2>Per-step log</h2>")
    parts.append('<p class="note">per request: prompt_len / total_len (tokens in its KV cache after the step) / '
                 "blocks held; * = prefill this step, ✓ = finished this step</p>")
    body = []
    for r in report.rows:
        done = {f["id"] for f in r["finished"]}
        cells = " ".join(
            f"{q['id']}:{q['prompt_len']}/{q['total_len']}/{q['blocks']}"
            + ("*" if q["phase"] == "prefill" else "") + ("✓" if q["id"] in done else "")
            for q in r["requests"]
        )
        body.append([r["step"], r["batch_size"], r["num_tokens"], r["free_blocks"], r["total_blocks"],
                     r["num_waiting"], f"{1000 * r['duration_s']:.1f}", cells])
    parts.append(_table(["step", "batch", "tokens", "free blocks", "total", "waiting", "ms", "requests"],
                        body, left={7}))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(report: TraceReport, path: str | Path, png: bytes | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(report, png), encoding="utf-8")
    return path
