"""The seed's picture in ASCII: one line per request, one column per step (or per few steps).

    step     1        10        20
    seq[6]   ▓███ ✓4
    seq[7]   ▓███████████████████████ ✓64
    batch    ██████▇▇▇▆▆▅▅▅▄▄▃▃▂▂▁▁▁▁
             step 4: seq[6] leaves (length)    batch 10 → 9
"""
from __future__ import annotations

from typing import Any

from octavo.tracing.spans import DECODE, PREEMPTED, PREFILL, WAITING, RequestSpan

CELL = {PREFILL: "▓", DECODE: "█", WAITING: "░", PREEMPTED: "✗"}
PRIORITY = {PREEMPTED: 3, PREFILL: 2, DECODE: 1, WAITING: 0}  # what a squeezed column shows
SPARK = " ▁▂▃▄▅▆▇█"
LEGEND = "▓ prefill (or a prefill chunk)   █ decode   ░ waiting   ✗ preempted   ✓N finished at step N"


def label_of(rid: str) -> str:
    return f"seq[{rid}]"


def render_timeline(rows: list[dict[str, Any]], spans: list[RequestSpan], max_width: int = 100) -> str:
    """Bars per request, batch-size and free-block sparklines, and who joins/leaves when."""
    if not rows:
        return "(empty trace)"
    first, last = rows[0]["step"], rows[-1]["step"]
    nsteps = last - first + 1
    per_col = max(1, -(-nsteps // max_width))  # steps per column
    ncols = -(-nsteps // per_col)
    col_of = lambda step: (step - first) // per_col  # noqa: E731
    labels = [label_of(s.id) for s in spans]
    pad = max([len(x) for x in labels] + [len("free blocks")]) + 2

    out = [LEGEND]
    if per_col > 1:
        out.append(f"(one column = {per_col} steps; a column shows the most eventful state in it)")
    out.append(" " * pad + _axis(first, last, per_col, ncols))
    for span, label in zip(spans, labels):
        cells = [" "] * ncols
        rank = [-1] * ncols
        for step, state in span.states.items():
            c = col_of(step)
            if PRIORITY[state] > rank[c]:
                cells[c], rank[c] = CELL[state], PRIORITY[state]
        bar = "".join(cells).rstrip()
        end = f" ✓{span.finished_step}" if span.finished_step is not None else " …"
        out.append(label.ljust(pad) + bar + end)
    by_col_batch = [0] * ncols
    by_col_free = [0] * ncols
    for row in rows:  # squeezed columns show the largest batch and the fewest free blocks
        c = col_of(row["step"])
        by_col_batch[c] = max(by_col_batch[c], row["batch_size"])
        by_col_free[c] = max(by_col_free[c], row["total_blocks"] - row["free_blocks"])
    max_batch = max(by_col_batch) or 1
    total_blocks = max(r["total_blocks"] for r in rows) or 1
    out.append("batch size".ljust(pad) + _spark(by_col_batch, max_batch) + f"  (max {max_batch})")
    out.append("used blocks".ljust(pad) + _spark(by_col_free, total_blocks) + f"  (of {total_blocks})")
    out.append("")
    out.extend(" " * pad + line for line in _events(rows))
    return "\n".join(out)


def _axis(first: int, last: int, per_col: int, ncols: int) -> str:
    chars = [" "] * (ncols + 8)
    marks = [first] + [s for s in range(first, last + 1) if s % (10 * per_col) == 0] + [last]
    for step in sorted(set(marks)):
        text = str(step)
        pos = (step - first) // per_col
        if all(ch == " " for ch in chars[max(0, pos - 1): pos + len(text) + 1]):
            chars[pos: pos + len(text)] = text
    return "".join(chars).rstrip()


def _spark(values: list[int], top: int) -> str:
    return "".join(SPARK[min(8, max(1, round(8 * v / top)))] if v else " " for v in values).rstrip()


def _events(rows: list[dict[str, Any]]) -> list[str]:
    """"step 4: seq[6] leaves (length)   batch 10 → 9" for every step where the batch changes hands."""
    lines = []
    for i, row in enumerate(rows):
        parts = []
        joined = row["arrived"]
        if len(joined) > 3:
            parts.append(f"{len(joined)} requests {'arrive' if i == 0 else 'join'}")
        elif joined:
            verb = ("arrives" if i == 0 else "joins") if len(joined) == 1 else ("arrive" if i == 0 else "join")
            parts.append(", ".join(map(label_of, joined)) + " " + verb)
        if row["preempted"]:
            parts.append(", ".join(map(label_of, row["preempted"])) + " preempted")
        if row["finished"]:
            names = ", ".join(label_of(f["id"]) for f in row["finished"])
            reasons = sorted({f["reason"] for f in row["finished"]})
            parts.append(f"{names} {'leaves' if len(row['finished']) == 1 else 'leave'} ({', '.join(reasons)})")
        if not parts:
            continue
        after = rows[i + 1]["batch_size"] if i + 1 < len(rows) else 0
        text = f"step {row['step']:>3}: " + "; ".join(parts)
        lines.append(f"{text:<58} batch {row['batch_size']} → {after}")
    return lines
