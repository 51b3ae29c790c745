"""The trace as a PNG (matplotlib, Agg canvas; no pyplot, no global state).

Four panels over the same step axis: the request timeline (waiting / prefill / decode / preempted,
a tick where each request finishes), batch size and queue, KV blocks used vs free, tokens per step.
"""
from __future__ import annotations

import io
from typing import Any

from octavo.errors import OctavoError
from octavo.tracing.memory import holding, memory_report
from octavo.tracing.spans import DECODE, PREEMPTED, PREFILL, WAITING, RequestSpan
from octavo.tracing.timeline import label_of

COLORS = {WAITING: "#d9d9d9", PREFILL: "#f28e2b", DECODE: "#4e79a7", PREEMPTED: "#e15759"}
NAMES = {WAITING: "waiting", PREFILL: "prefill", DECODE: "decode", PREEMPTED: "preempted"}


def _figure_classes():  # noqa: ANN202
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # matplotlib is the optional "plot" extra
        raise OctavoError(
            "drawing a PNG needs matplotlib: pip install 'octavo[plot]' (or pip install matplotlib)"
        ) from exc
    return Figure, FigureCanvasAgg


def _segments(span: RequestSpan) -> list[tuple[str, int, int]]:
    """Runs of equal state: (state, first step, length)."""
    runs: list[tuple[str, int, int]] = []
    for step in sorted(span.states):
        state = span.states[step]
        if runs and runs[-1][0] == state and runs[-1][1] + runs[-1][2] == step:
            runs[-1] = (state, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((state, step, 1))
    return runs


def render_png_bytes(
    rows: list[dict[str, Any]], spans: list[RequestSpan], labels: dict[str, str] | None = None, title: str = ""
) -> bytes:
    """The four-panel figure as PNG bytes."""
    from matplotlib.patches import Patch

    Figure, FigureCanvasAgg = _figure_classes()
    labels = labels or {}
    n = max(1, len(spans))
    steps = [r["step"] for r in rows]
    first, last = steps[0], steps[-1]
    fig = Figure(figsize=(13, 3.2 + 0.42 * n + 6.3), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(4, 1, height_ratios=[1.2 + 0.42 * n, 2.0, 2.1, 2.0])
    ax_tl = fig.add_subplot(grid[0])
    ax_b = fig.add_subplot(grid[1], sharex=ax_tl)
    ax_m = fig.add_subplot(grid[2], sharex=ax_tl)
    ax_t = fig.add_subplot(grid[3], sharex=ax_tl)

    # 1. timeline: one row per request, top to bottom in arrival order
    for i, span in enumerate(spans):
        y = n - 1 - i
        for state, start, length in _segments(span):
            ax_tl.broken_barh([(start - 0.5, length)], (y - 0.35, 0.7), facecolors=COLORS[state], edgecolor="none")
        if span.finished_step is not None:
            x = span.finished_step + 0.5
            ax_tl.plot([x, x], [y - 0.42, y + 0.42], color="black", lw=1.6)
            ax_tl.text(x + 0.6, y, f"done @ {span.finished_step}", va="center", fontsize=8)
    ax_tl.set_yticks(range(n))
    ax_tl.set_yticklabels(
        [" ".join(filter(None, [label_of(s.id), labels.get(s.id), f"({s.prompt_len}+{s.output_len} tok)"]))
         for s in reversed(spans)], fontsize=8.5,
    )
    ax_tl.set_ylim(-0.7, n - 0.3)
    ax_tl.set_title(title or "Continuous batching: every request enters, runs and leaves on its own step", fontsize=11)
    ax_tl.legend(
        handles=[Patch(color=COLORS[k], label=NAMES[k]) for k in (PREFILL, DECODE, WAITING, PREEMPTED)]
        + [Patch(color="black", label="finished")],
        loc="upper right", fontsize=8, ncol=5, framealpha=0.9,
    )
    ax_tl.grid(axis="x", color="#eeeeee")
    ax_tl.set_axisbelow(True)

    # 2. batch size (sequences scheduled) and queue length
    ax_b.step(steps, [r["batch_size"] for r in rows], where="mid", color="#4e79a7", lw=2, label="batch size (scheduled)")
    waiting = [r["num_waiting"] for r in rows]
    if any(waiting):
        ax_b.step(steps, waiting, where="mid", color="#bab0ac", lw=1.5, ls="--", label="waiting")
    for r in rows:
        if r["finished"]:
            ax_b.axvline(r["step"] + 0.5, color="#cccccc", lw=0.8, zorder=0)
    ax_b.set_ylabel("sequences")
    ax_b.set_ylim(bottom=0)
    ax_b.legend(loc="upper right", fontsize=8)
    ax_b.set_title("Batch size changes every time a request leaves or joins", fontsize=10)

    # 3. KV blocks: used (requests' blocks) vs free; the tokens held, in blocks, shows the last-block slack
    bs = rows[0]["block_size"]
    used = [r["total_blocks"] - r["free_blocks"] for r in rows]
    held = [sum(q["total_len"] for q in holding(r)) / bs for r in rows]
    ax_m.fill_between(steps, used, step="mid", color="#59a14f", alpha=0.35, label="blocks in use")
    ax_m.step(steps, used, where="mid", color="#59a14f", lw=1.5)
    ax_m.step(steps, [r["free_blocks"] for r in rows], where="mid", color="#e15759", lw=1.5, label="free blocks")
    ax_m.step(steps, held, where="mid", color="black", lw=1, ls=":", label="tokens in the requests' caches / block_size")
    ax_m.axhline(rows[0]["total_blocks"], color="#888888", lw=1, ls="--", label=f"pool: {rows[0]['total_blocks']} blocks")
    ax_m.set_ylabel(f"blocks of {bs} tokens")
    ax_m.set_ylim(0, max(r["total_blocks"] for r in rows) * 1.38)
    ax_m.legend(loc="upper right", fontsize=8, ncol=4)
    mem = memory_report(rows, spans)
    share = " (shared prefix blocks count once in the pool)" \
        if mem.peak_used_blocks < mem.peak_request_blocks else ""
    ax_m.set_title(
        "Paged KV cache: blocks are taken on demand and given back when a request leaves\n"
        f"peak: {mem.peak_used_blocks} blocks in use; requests held {mem.peak_request_blocks} blocks = "
        f"{mem.peak_request_blocks * bs} slots for {mem.peak_tokens} tokens, {mem.peak_unused} slots "
        f"({100 * mem.peak_unused / max(1, mem.peak_request_blocks * bs):.1f}%) empty in last blocks{share}",
        fontsize=9.5)

    # 4. tokens per step, split into prefill and decode tokens
    pre = [sum(q["tokens"] for q in r["requests"] if q["phase"] == PREFILL) for r in rows]
    dec = [sum(q["tokens"] for q in r["requests"] if q["phase"] == DECODE) for r in rows]
    ax_t.bar(steps, dec, width=0.85, color=COLORS[DECODE], label="decode tokens")
    ax_t.bar(steps, pre, width=0.85, bottom=dec, color=COLORS[PREFILL], label="prefill tokens")
    top = max((p + d for p, d in zip(pre, dec)), default=1)
    if max(pre, default=0) > 8 * max(max(dec, default=1), 1):  # one big prefill would flatten the decodes
        lin = max(max(dec, default=1), 1) * 2
        ax_t.set_yscale("symlog", linthresh=lin)
        ticks = [0] + [m * 10**e for e in range(0, 7) for m in (1, 2, 5) if lin / 2 <= m * 10**e <= top * 1.5]
        ax_t.set_yticks(ticks if len(ticks) <= 12 else ticks[::2])
        ax_t.set_yticklabels([str(t) for t in (ticks if len(ticks) <= 12 else ticks[::2])])
    ax_t.set_ylabel("tokens")
    ax_t.set_xlabel("engine step")
    ax_t.legend(loc="upper right", fontsize=8)
    ax_t.set_title("Tokens computed per step (one forward pass over all scheduled sequences)", fontsize=10)
    ax_t.set_xlim(first - 0.8, last + max(6, 0.08 * (last - first + 1)))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
