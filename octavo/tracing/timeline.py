"""The seed's picture in ASCII: one line per request, one column per step (or per few steps).

    step     1        10        20
    seq[6]   ▓███ ✓4
    seq[7]   ▓███████████████████████ ✓64
    batch    ██████▇▇▇▆▆▅▅▅▄▄▃▃▂▂▁▁▁▁
             step 4: seq[6] leaves (length)    batch 10 → 9
"""
from __future__ import annotations

from typing import Any

from octavo.tracing.names import short_ids
from octavo.tracing.spans import DECODE, PREEMPTED, PREFILL, WAITING, RequestSpan

CELL = {PREFILL: "▓", DECODE: "█", WAITING: "░", PREEMPTED: "✗"}
PRIORITY = {PREEMPTED: 3, PREFILL: 2, DECODE: 1, WAITING: 0}  # what a squeezed column shows
SPARK = " ▁▂▃▄▅▆▇█"
LEGEND = ("▓ prefill (or a prefill chunk)   █ decode   ░ waiting   ✗ preempted   ✓N finished at step N   "
          "⊘N aborted (or failed) at step N")


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
    names = short_ids([s.id for s in spans])
    labels = [label_of(names[s.id]) for s in spans]
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
        end = " …" if span.finished_step is None else f" ✓{span.finished_step}" \
            if span.finish_reason in ("length", "stop", None, "?") else f" ⊘{span.finished_step} {span.finish_reason}"
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
    peak = max(by_col_free) or 1  # scaled to the peak: a light load on a large pool is not an empty line
    out.append("used blocks".ljust(pad) + _spark(by_col_free, peak) + f"  (peak {peak} of {total_blocks})")
    out.append("")
    out.extend(" " * pad + line for line in _events(rows, names))
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


def _names(ids: list[str], names: dict[str, str] | None = None) -> str:
    names = names or {}
    return ", ".join(label_of(names.get(i, i)) for i in ids) if len(ids) <= 4 else f"{len(ids)} requests"


def _events(rows: list[dict[str, Any]], names: dict[str, str] | None = None) -> list[str]:
    """"step 4: seq[6] leaves (length)   batch 10 → 9" for every step where the batch changes hands."""
    lines = []
    seen: set[str] = set()
    carried: set[str] = set()  # scheduled in the previous step and not finished there
    for i, row in enumerate(rows):
        this = row["batch_size"]
        sched = [q["id"] for q in row["requests"]]
        entering = [rid for rid in sched if rid not in carried]
        arrived = set(row["arrived"])
        parts = []
        joins = [rid for rid in entering if rid in arrived]
        if joins:
            parts.append(f"{_names(joins, names)} {'arrive' if i == 0 else 'join'}{'s' if len(joins) == 1 else ''}")
        queued = [rid for rid in row["arrived"] if rid not in sched]
        if queued:
            parts.append(f"{_names(queued, names)} arrive{'s' if len(queued) == 1 else ''} and wait{'s' if len(queued) == 1 else ''}")
        admitted = [rid for rid in entering if rid not in arrived and rid not in seen]
        if admitted:
            parts.append(f"{_names(admitted, names)} admitted from the queue")
        resumed = [rid for rid in entering if rid not in arrived and rid in seen]
        if resumed:
            parts.append(f"{_names(resumed, names)} resume{'s' if len(resumed) == 1 else ''}")
        if row["preempted"]:
            parts.append(f"{_names(row['preempted'], names)} preempted (blocks freed, recomputed later)")
        if row["finished"]:
            ids = [f["id"] for f in row["finished"]]
            reasons = sorted({f["reason"] for f in row["finished"]})
            parts.append(f"{_names(ids, names)} {'leaves' if len(ids) == 1 else 'leave'} ({', '.join(reasons)})")
        before = len(carried)
        after = this - len(row["finished"])
        seen.update(sched)
        carried = set(sched) - {f["id"] for f in row["finished"]}
        if not parts:
            continue
        sizes = ([before] if i > 0 and before != this else []) + [this] + ([after] if after != this else [])
        text = f"step {row['step']:>3}: " + "; ".join(parts)
        lines.append(f"{text:<62} batch {' → '.join(map(str, sizes)):<12} free blocks {row['free_blocks']}")
    return lines
