"""The trace as a PNG (matplotlib, Agg canvas; no pyplot, no global state).

Four panels over one x-axis: the request timeline (waiting / prefill / decode / preempted, a mark where each
request ends, labelled with how it ended: done, abort or error), batch size and queue, KV blocks in use, tokens
per step. The x-axis is engine steps (the demo's picture) or wall time (`x_axis="time"`: a server's trace,
where the idle time between requests is real and visible). The KV panel is scaled to the blocks actually used,
so a small load on a large pool is not a flat line; long request ids are shortened (names.short_ids).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from octavo.errors import InvalidRequestError, OctavoError
from octavo.tracing.memory import holding, memory_report
from octavo.tracing.names import short_ids
from octavo.tracing.spans import DECODE, PREEMPTED, PREFILL, WAITING, RequestSpan
from octavo.tracing.timeline import label_of

COLORS = {WAITING: "#d9d9d9", PREFILL: "#f28e2b", DECODE: "#4e79a7", PREEMPTED: "#e15759"}
NAMES = {WAITING: "waiting", PREFILL: "prefill", DECODE: "decode", PREEMPTED: "preempted"}
END_WORDS = {"length": "done", "stop": "done", "abort": "abort", "error": "error"}  # finish_reason -> the mark's word
END_COLORS = {"done": "black", "abort": "#b07aa1", "error": "#e15759"}
X_AXES = ("step", "time")
MAX_TICK_LABELS = 60  # more requests than this: rows stay, every k-th is labelled


def _figure_classes():  # noqa: ANN202
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # matplotlib is the optional "plot" extra
        raise OctavoError(
            "drawing a PNG needs matplotlib: pip install 'octavo[plot]' (or pip install matplotlib)"
        ) from exc
    return Figure, FigureCanvasAgg


@dataclass(slots=True)
class Axis:
    """Where each step lies on the x-axis: [start, end) in steps (step - 0.5, step + 0.5) or in seconds since
    the first step started (from the rows' time and duration_s)."""

    kind: str
    start: dict[int, float]
    end: dict[int, float]

    @classmethod
    def of(cls, rows: list[dict[str, Any]], kind: str) -> "Axis":
        if kind not in X_AXES:
            raise InvalidRequestError(f"x axis must be one of {', '.join(X_AXES)}, got {kind!r}")
        if kind == "step":
            return cls(kind, {r["step"]: r["step"] - 0.5 for r in rows}, {r["step"]: r["step"] + 0.5 for r in rows})
        if not any(r["time"] for r in rows):
            raise InvalidRequestError("this trace has no wall-clock times (its rows lack 'time'); draw it by step")
        t0 = min(r["time"] - r["duration_s"] for r in rows)
        # a step's width is at least a sliver, so a 1 ms step of a 10-minute trace is still drawn
        span = max(r["time"] for r in rows) - t0
        least = span / 2000 if span > 0 else 1e-3
        start = {r["step"]: r["time"] - r["duration_s"] - t0 for r in rows}
        end = {r["step"]: max(r["time"] - t0, start[r["step"]] + least) for r in rows}
        return cls(kind, start, end)

    def label(self) -> str:
        return "engine step" if self.kind == "step" else "wall time since the first step (s)"

    def where(self, step: int) -> str:
        return f"{step}" if self.kind == "step" else f"{self.end[step]:.1f} s"


def _segments(span: RequestSpan) -> list[tuple[str, int, int]]:
    """Runs of equal state: (state, first step, last step)."""
    runs: list[tuple[str, int, int]] = []
    for step in sorted(span.states):
        state = span.states[step]
        if runs and runs[-1][0] == state and runs[-1][2] + 1 == step:
            runs[-1] = (state, runs[-1][1], step)
        else:
            runs.append((state, step, step))
    return runs


def end_word(reason: str | None) -> str:
    return END_WORDS.get(reason or "", reason or "done")


def build_figure(rows: list[dict[str, Any]], spans: list[RequestSpan], labels: dict[str, str] | None = None,
                 title: str = "", x_axis: str = "step"):  # noqa: ANN201 - a matplotlib Figure
    """The four-panel figure (a matplotlib Figure on an Agg canvas)."""
    from matplotlib.patches import Patch

    Figure, FigureCanvasAgg = _figure_classes()
    labels = labels or {}
    axis = Axis.of(rows, x_axis)
    names = short_ids([s.id for s in spans])
    n = max(1, len(spans))
    row_h = min(0.42, 24 / n)  # inches per request: a long server trace stays a readable height
    fig = Figure(figsize=(13, 3.2 + row_h * n + 6.3), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(4, 1, height_ratios=[1.2 + row_h * n, 2.0, 2.1, 2.0])
    ax_tl = fig.add_subplot(grid[0])
    ax_b = fig.add_subplot(grid[1], sharex=ax_tl)
    ax_m = fig.add_subplot(grid[2], sharex=ax_tl)
    ax_t = fig.add_subplot(grid[3], sharex=ax_tl)
    steps = [r["step"] for r in rows]
    starts = [axis.start[s] for s in steps]
    widths = [axis.end[s] - axis.start[s] for s in steps]

    # 1. timeline: one row per request, top to bottom in arrival order; the end mark says how it ended
    ends_seen = set()
    for i, span in enumerate(spans):
        y = n - 1 - i
        for state, a, b in _segments(span):
            ax_tl.broken_barh([(axis.start[a], axis.end[b] - axis.start[a])], (y - 0.35, 0.7),
                              facecolors=COLORS[state], edgecolor="none")
        if span.finished_step is not None:
            word = end_word(span.finish_reason)
            ends_seen.add(word)
            x = axis.end[span.finished_step]
            color = END_COLORS.get(word, "black")
            ax_tl.plot([x, x], [y - 0.42, y + 0.42], color=color, lw=1.6)
            if n <= MAX_TICK_LABELS:
                ax_tl.text(x, y, f" {word} @ {axis.where(span.finished_step)}", va="center", fontsize=8, color=color)
    every = max(1, -(-n // MAX_TICK_LABELS))
    shown = [i for i in range(n) if i % every == 0]
    ax_tl.set_yticks([n - 1 - i for i in shown])
    ax_tl.set_yticklabels(
        [" ".join(filter(None, [label_of(names[spans[i].id]), labels.get(spans[i].id),
                                f"({spans[i].prompt_len}+{spans[i].output_len} tok)"])) for i in shown],
        fontsize=8.5 if n <= 30 else 7)
    ax_tl.set_ylim(-0.7, n - 0.3)
    ax_tl.set_title(title or "Continuous batching: every request enters, runs and leaves on its own step", fontsize=11)
    ax_tl.legend(
        handles=[Patch(color=COLORS[k], label=NAMES[k]) for k in (PREFILL, DECODE, WAITING, PREEMPTED)]
        + [Patch(color=END_COLORS.get(w, "black"), label=w) for w in ("done", "abort", "error") if w in ends_seen],
        loc="upper right", fontsize=8, ncol=7, framealpha=0.9,
    )
    ax_tl.grid(axis="x", color="#eeeeee")
    ax_tl.set_axisbelow(True)

    # 2. batch size (sequences scheduled) and queue length; bars, so idle time shows as empty
    ax_b.bar(starts, [r["batch_size"] for r in rows], width=widths, align="edge", color="#4e79a7",
             label="batch size (scheduled)")
    waiting = [r["num_waiting"] for r in rows]
    if any(waiting):
        ax_b.step([axis.end[s] for s in steps], waiting, where="pre", color="#bab0ac", lw=1.5, ls="--",
                  label="waiting")
    for r in rows:
        if r["finished"]:
            ax_b.axvline(axis.end[r["step"]], color="#cccccc", lw=0.8, zorder=0)
    ax_b.set_ylabel("sequences")
    ax_b.set_ylim(bottom=0)
    ax_b.legend(loc="upper right", fontsize=8)
    ax_b.set_title("Batch size changes every time a request leaves or joins", fontsize=10)

    # 3. KV blocks in use, scaled to what was used (a large pool is a number in the title, not a flat line)
    bs = rows[0]["block_size"]
    pool = max(r["total_blocks"] for r in rows)
    used = [r["total_blocks"] - r["free_blocks"] for r in rows]
    held = [sum(q["total_len"] for q in holding(r)) / bs for r in rows]
    if axis.kind == "step":  # a value per step, drawn across its step
        xs, kw = steps, {"where": "mid"}
    else:  # the blocks held after a step, until the next step ends: idle time keeps what was held
        xs, kw = [axis.end[s] for s in steps], {"where": "post"}
    ax_m.fill_between(xs, used, step=kw["where"], color="#59a14f", alpha=0.35, label="blocks in use")
    ax_m.step(xs, used, color="#59a14f", lw=1.5, **kw)
    ax_m.step(xs, held, color="black", lw=1, ls=":", label="tokens in the requests' caches / block_size", **kw)
    top = max(max(used, default=0), max(held, default=0), 1) * 1.35
    if pool <= top * 1.1:  # the pool is within reach of the scale: draw its line
        ax_m.axhline(pool, color="#888888", lw=1, ls="--", label=f"pool: {pool} blocks")
        top = max(top, pool * 1.38)
    ax_m.set_ylabel(f"blocks of {bs} tokens")
    ax_m.set_ylim(0, top)
    ax_m.legend(loc="upper right", fontsize=8, ncol=3)
    mem = memory_report(rows, spans)
    share = " (shared prefix blocks count once in the pool)" \
        if mem.peak_used_blocks < mem.peak_request_blocks else ""
    ax_m.set_title(
        f"Paged KV cache: blocks are taken on demand and given back when a request leaves; peak "
        f"{mem.peak_used_blocks} of the pool's {pool} blocks ({100 * mem.peak_used_blocks / max(1, pool):.1f}%)\n"
        f"requests held {mem.peak_request_blocks} blocks = {mem.peak_request_blocks * bs} slots for "
        f"{mem.peak_tokens} tokens, {mem.peak_unused} slots "
        f"({100 * mem.peak_unused / max(1, mem.peak_request_blocks * bs):.1f}%) empty in last blocks{share}",
        fontsize=9.5)

    # 4. tokens per step, split into prefill and decode tokens
    pre = [sum(q["tokens"] for q in r["requests"] if q["phase"] == PREFILL) for r in rows]
    dec = [sum(q["tokens"] for q in r["requests"] if q["phase"] == DECODE) for r in rows]
    bar_w = [w * (0.85 if axis.kind == "step" else 1.0) for w in widths]
    ax_t.bar(starts, dec, width=bar_w, align="edge", color=COLORS[DECODE], label="decode tokens")
    ax_t.bar(starts, pre, width=bar_w, align="edge", bottom=dec, color=COLORS[PREFILL], label="prefill tokens")
    most = max((p + d for p, d in zip(pre, dec)), default=1)
    if max(pre, default=0) > 8 * max(max(dec, default=1), 1):  # one big prefill would flatten the decodes
        lin = max(max(dec, default=1), 1) * 2
        ax_t.set_yscale("symlog", linthresh=lin)
        ticks = [0] + [m * 10**e for e in range(0, 7) for m in (1, 2, 5) if lin / 2 <= m * 10**e <= most * 1.5]
        ax_t.set_yticks(ticks if len(ticks) <= 12 else ticks[::2])
        ax_t.set_yticklabels([str(t) for t in (ticks if len(ticks) <= 12 else ticks[::2])])
    ax_t.set_ylabel("tokens")
    ax_t.set_xlabel(axis.label())
    ax_t.legend(loc="upper right", fontsize=8)
    ax_t.set_title("Tokens computed per step (one forward pass over all scheduled sequences)", fontsize=10)
    left, right = min(axis.start.values()), max(axis.end.values())
    room = max(6.0, 0.08 * (right - left)) if axis.kind == "step" else 0.12 * (right - left)  # for the end labels
    ax_t.set_xlim(left - 0.3 if axis.kind == "step" else left - 0.01 * (right - left), right + room)
    return fig


def render_png_bytes(rows: list[dict[str, Any]], spans: list[RequestSpan], labels: dict[str, str] | None = None,
                     title: str = "", x_axis: str = "step") -> bytes:
    """The four-panel figure as PNG bytes."""
    fig = build_figure(rows, spans, labels, title, x_axis)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
