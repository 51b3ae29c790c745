"""Trace reading and rendering on hand-written rows (no engine): every number is worked out by hand here.

The trace (block_size 4, pool 10 blocks):
  a: prompt 5, 3 tokens; arrives before step 1, prefilled in step 1, finishes at step 3.
  b: prompt 2, 4 tokens; arrives before step 1, prefilled in step 1, preempted at step 3 (pool pressure),
     prefilled again (recompute of 2 prompt + 2 generated = 4 tokens) at step 4, finishes at step 5.
  c: prompt 6, 2 tokens; joins before step 2 (mid-stream), prefilled in chunks of 4 + 2 (steps 2, 3),
     finishes at step 4.
"""
from __future__ import annotations

import base64
import json
import re
import struct

import pytest

from octavo.cli import main
from octavo.errors import TraceFormatError
from octavo.tracing.files import write_outputs
from octavo.tracing.html import render_html
from octavo.tracing.memory import memory_report
from octavo.tracing.plot import render_png_bytes
from octavo.tracing.reader import check_rows, read_trace, write_trace
from octavo.tracing.report import build_report, format_terminal
from octavo.tracing.spans import DECODE, PREEMPTED, PREFILL, build_spans, format_table
from octavo.tracing.steplog import format_step
from octavo.tracing.timeline import render_timeline


def req(rid: str, phase: str, tokens: int, prompt: int, total: int, out: int, blocks: int) -> dict:
    return {"id": rid, "phase": phase, "tokens": tokens, "prompt_len": prompt, "total_len": total,
            "output_len": out, "blocks": blocks, "cached": 0}


def row(step: int, reqs: list[dict], free: int, *, arrived=(), finished=(), preempted=(), waiting=0) -> dict:
    return {"step": step, "time": 1000.0 + step, "duration_s": 0.01, "batch_size": len(reqs),
            "num_tokens": sum(r["tokens"] for r in reqs), "num_waiting": waiting, "free_blocks": free,
            "total_blocks": 10, "block_size": 4, "requests": reqs, "arrived": list(arrived),
            "finished": [{"id": f, "reason": "length"} for f in finished], "preempted": list(preempted)}


ROWS = [
    # a: 5 tokens -> 2 blocks; b: 2 tokens -> 1 block; free 10 - 3 = 7
    row(1, [req("a", "prefill", 5, 5, 5, 1, 2), req("b", "prefill", 2, 2, 2, 1, 1)], 7, arrived=["a", "b"]),
    # c joins: chunk of 4 -> 1 block; a 6 tokens (2 blocks), b 3 (1): used 4
    row(2, [req("a", "decode", 1, 5, 6, 2, 2), req("b", "decode", 1, 2, 3, 2, 1), req("c", "prefill", 4, 6, 4, 0, 1)],
        6, arrived=["c"]),
    # b preempted (its block freed); a 7 tokens, finishes (blocks freed after the step); c 6 (2 blocks)
    row(3, [req("a", "decode", 1, 5, 7, 3, 2), req("c", "prefill", 2, 6, 6, 1, 2)], 8,
        finished=["a"], preempted=["b"], waiting=1),
    # b recomputed: 2 prompt + 2 generated = 4 tokens (1 block), samples its 3rd; c 7 tokens, finishes
    row(4, [req("c", "decode", 1, 6, 7, 2, 2), req("b", "prefill", 4, 2, 4, 3, 1)], 9, finished=["c"]),
    row(5, [req("b", "decode", 1, 2, 5, 4, 2)], 10, finished=["b"]),
]


def test_reader_round_trip_and_errors(tmp_path):
    path = write_trace(ROWS, tmp_path / "t.jsonl")
    assert read_trace(path) == check_rows(ROWS)
    # optional fields are filled in, required ones are checked, with the line number
    minimal = {k: v for k, v in ROWS[0].items() if k not in ("time", "num_waiting", "arrived", "preempted")}
    assert check_rows([minimal])[0]["arrived"] == []
    bad = dict(ROWS[1], requests=[{"id": "a", "phase": "thinking", "tokens": 1, "prompt_len": 1, "total_len": 1,
                                   "blocks": 1}])
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceFormatError, match="phase"):
        read_trace(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(TraceFormatError, match=r"broken.jsonl:2"):
        read_trace(tmp_path / "broken.jsonl")
    with pytest.raises(TraceFormatError, match="free_blocks"):
        check_rows([{k: v for k, v in ROWS[0].items() if k != "free_blocks"}])
    with pytest.raises(TraceFormatError, match="does not follow"):
        check_rows([ROWS[1], ROWS[0]])
    with pytest.raises(TraceFormatError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceFormatError, match="no rows"):
        read_trace(tmp_path / "empty.jsonl")


def test_spans_follow_each_request():
    spans = {s.id: s for s in build_spans(check_rows(ROWS))}
    assert [s.id for s in build_spans(check_rows(ROWS))] == ["a", "b", "c"]  # arrival order
    a, b, c = spans["a"], spans["b"], spans["c"]
    assert (a.arrived_step, a.first_step, a.finished_step, a.output_len, a.total) == (1, 1, 3, 3, 8)
    assert a.states == {1: PREFILL, 2: DECODE, 3: DECODE}
    assert b.states == {1: PREFILL, 2: DECODE, 3: PREEMPTED, 4: PREFILL, 5: DECODE}
    assert (b.preemptions, b.prefill_steps, b.finished_step, b.output_len) == (1, 2, 5, 4)
    assert (c.arrived_step, c.first_step, c.prefill_steps, c.finished_step) == (2, 2, 2, 4)
    assert c.states == {2: PREFILL, 3: PREFILL, 4: DECODE}
    table = format_table(list(spans.values()), {"a": "alpha", "b": "beta", "c": "gamma"})
    assert re.search(r"a\s+alpha\s+5 tok\s+3 tok\s+8 total\s+step 1\s+step 3", table)
    assert re.search(r"c\s+gamma\s+6 tok\s+2 tok\s+8 total\s+step 2\s+step 4", table)  # staggered: arrival shown


def test_timeline_and_step_log():
    rows = check_rows(ROWS)
    text = render_timeline(rows, build_spans(rows))
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("seq[")}
    assert lines["seq[a]"].endswith("▓██ ✓3")
    assert lines["seq[b]"].endswith("▓█✗▓█ ✓5")
    assert lines["seq[c]"].endswith(" ▓▓█ ✓4")  # joins at step 2: blank first column
    assert re.search(r"step\s+2: seq\[c\] joins\s+batch 2 → 3", text)
    # step 3: b is preempted (3 → 2 scheduled), a leaves after it (2 → 1)
    assert re.search(r"step\s+3: seq\[b\] preempted.*seq\[a\] leaves \(length\)\s+batch 3 → 2 → 1", text)
    assert re.search(r"step\s+4: seq\[b\] resumes; seq\[c\] leaves \(length\)\s+batch 1 → 2 → 1", text)
    assert re.search(r"step\s+5: seq\[b\] leaves \(length\)\s+batch 1 → 0", text)
    assert format_step(rows[2]) == "   3     2      3     8/10       1 | a:5/7/2✓ c:6/6/2* b✗"


def test_timeline_squeezes_long_traces():
    rows = check_rows([row(s, [req("x", "prefill" if s == 1 else "decode", 1, 1, s, s, 1)], 9,
                           arrived=["x"] if s == 1 else [], finished=["x"] if s == 300 else [])
                       for s in range(1, 301)])
    text = render_timeline(rows, build_spans(rows), max_width=100)
    assert "one column = 3 steps" in text
    bar = next(ln for ln in text.splitlines() if ln.startswith("seq[x]"))
    assert bar.split()[1] == "▓" + "█" * 99 and bar.endswith("✓300")


def test_memory_report_is_measured_from_the_rows():
    rows = check_rows(ROWS)
    m = memory_report(rows, build_spans(rows), max_num_seqs=8, max_model_len=32, bytes_per_slot=100)
    # peak pool use: step 2 (10 - 6 = 4 blocks); held then: a 6 tok/2 blk, b 3/1, c 4/1
    assert (m.peak_step, m.peak_used_blocks, m.peak_request_blocks, m.peak_tokens) == (2, 4, 4, 13)
    assert m.peak_unused == 4 * 4 - 13
    # per request, at its last scheduled step: a 7 tok in 2 blocks, b 5 in 2, c 7 in 2
    assert [(r.id, r.tokens, r.blocks, r.unused) for r in m.requests] == [("a", 7, 2, 1), ("b", 5, 2, 3), ("c", 7, 2, 1)]
    assert m.static_padded_slots == 3 * (6 + 4)  # 3 requests x (max prompt 6 + max output 4)
    assert m.static_max_len_slots == 8 * 32
    # slot-steps: pool used 3, 4, 2, 1, 0 blocks; requests still holding after each step (finished ones excluded)
    assert m.pool_slot_steps == 4 * (3 + 4 + 2 + 1 + 0)
    assert m.request_slot_steps == 4 * ((2 + 1) + (2 + 1 + 1) + 2 + 1 + 0)
    assert m.token_slot_steps == (5 + 2) + (6 + 3 + 4) + 6 + 4 + 0
    assert m.static_slot_steps == 30 * 5


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_png_html_and_terminal_report():
    rows = check_rows(ROWS)
    report = build_report(rows, title="hand-written", labels={"a": "alpha"}, answers={"a": "x < y & z"})
    png = render_png_bytes(report.rows, report.spans, report.labels, report.title)
    width, height = _png_size(png)
    assert width > 1000 and height > 800
    page = render_html(report, png)
    assert base64.b64encode(png).decode() in page
    assert "x &lt; y &amp; z" in page  # escaped
    assert "<script" not in page and "http://" not in page and "https://" not in page
    text = format_terminal(report)
    for heading in ("Requests", "Per-step log", "Timeline", "KV memory, measured", "Answers"):
        assert f"=== {heading} " in text


def test_trace_command(tmp_path, capsys):
    path = write_trace(ROWS, tmp_path / "t.jsonl")
    rc = main(["trace", str(path), "--png", str(tmp_path / "t.png"), "--html", str(tmp_path / "t.html")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "seq[b]" in out and "✓5" in out and "Not zero waste" in out
    assert _png_size((tmp_path / "t.png").read_bytes())[0] > 1000
    assert "data:image/png;base64," in (tmp_path / "t.html").read_text()
    assert main(["trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_write_outputs_html_only(tmp_path):
    report = build_report(check_rows(ROWS))
    (html_path,) = write_outputs(report, html=tmp_path / "only.html")
    assert "data:image/png;base64," in html_path.read_text()


# ---- a server's trace: long ids, an abort, idle time between requests, a large pool ----------------------------
LONG_A = "cmpl-3f2a9c4b5e6d7f8a9b0c1d2e3f4a5b6c-0"
LONG_B = "cmpl-77e1d0c9b8a7f6e5d4c3b2a1f0e9d8c7-0"
POOL = 4096


def serve_row(step: int, t: float, reqs: list[dict], used: int, *, arrived=(), finished=()) -> dict:
    r = row(step, reqs, POOL - used, arrived=arrived)
    r.update(time=t, total_blocks=POOL, finished=[{"id": f, "reason": why} for f, why in finished])
    return r


SERVE_ROWS = [  # A runs steps 1-3 and is aborted at 3; 50 s of nothing; B runs steps 4-5 and finishes
    serve_row(1, 100.01, [req(LONG_A, "prefill", 5, 5, 5, 1, 2)], 2, arrived=[LONG_A]),
    serve_row(2, 100.02, [req(LONG_A, "decode", 1, 5, 6, 2, 2)], 2),
    serve_row(3, 100.03, [req(LONG_A, "decode", 1, 5, 7, 3, 2)], 0, finished=[(LONG_A, "abort")]),
    serve_row(4, 150.01, [req(LONG_B, "prefill", 6, 6, 6, 1, 2)], 2, arrived=[LONG_B]),
    serve_row(5, 150.02, [req(LONG_B, "decode", 1, 6, 7, 2, 2)], 0, finished=[(LONG_B, "length")]),
]


def _texts(ax) -> list[str]:  # noqa: ANN001
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("x_axis", ["step", "time"])
def test_a_server_trace_picture_says_abort_scales_kv_and_shortens_ids(x_axis: str) -> None:
    from octavo.tracing.plot import build_figure

    rows = check_rows(SERVE_ROWS)
    spans = build_spans(rows)
    fig = build_figure(rows, spans, x_axis=x_axis)
    ax_tl, ax_b, ax_m, ax_t = fig.axes
    ends = _texts(ax_tl)
    where = {"step": (" abort @ 3", " done @ 5"), "time": (" abort @ 0.0 s", " done @ 50.0 s")}[x_axis]
    assert ends == list(where), ends  # the aborted request is not drawn as done
    labels = [t.get_text() for t in ax_tl.get_yticklabels()]
    assert len(set(labels)) == 2 and all(len(label.split()[0]) <= len("seq[]") + 13 for label in labels), labels
    assert ax_m.get_ylim()[1] < 10  # 2 blocks used of 4096: scaled to the use, not a flat line at the bottom
    assert f"of the pool's {POOL} blocks" in ax_m.get_title()
    bars = sorted(p.get_x() for p in ax_b.patches)
    if x_axis == "time":  # B's steps start 50 s after A's: the idle time is on the axis
        assert bars[3] - bars[2] > 49 and "wall time" in ax_t.get_xlabel()
    else:
        assert bars == [0.5, 1.5, 2.5, 3.5, 4.5] and ax_t.get_xlabel() == "engine step"
    assert _png_size(render_png_bytes(rows, spans, x_axis=x_axis))[0] > 1000


def test_a_server_trace_in_the_terminal_says_abort_and_shortens_ids(tmp_path, capsys) -> None:  # noqa: ANN001
    rows = check_rows(SERVE_ROWS)
    text = render_timeline(rows, build_spans(rows))
    bars = [ln for ln in text.splitlines() if ln.startswith("seq[")]
    assert bars[0].endswith("▓██ ⊘3 abort") and bars[1].endswith("▓█ ✓5"), bars
    assert all(len(ln.split()[0]) <= len("seq[]") + 13 for ln in bars) and LONG_A not in text
    assert "(peak 2 of 4096)" in text
    path = write_trace(SERVE_ROWS, tmp_path / "serve.jsonl")
    assert main(["trace", str(path), "--x-axis", "time", "--png", str(tmp_path / "s.png"), "--no-log"]) == 0
    assert _png_size((tmp_path / "s.png").read_bytes())[0] > 1000
    with pytest.raises(SystemExit):  # argparse refuses an unknown axis
        main(["trace", str(path), "--x-axis", "sideways"])


def test_a_trace_without_times_refuses_the_time_axis() -> None:
    from octavo.errors import InvalidRequestError
    from octavo.tracing.plot import build_figure

    rows = check_rows([{k: v for k, v in r.items() if k not in ("time", "duration_s")} for r in SERVE_ROWS])
    with pytest.raises(InvalidRequestError, match="draw it by step"):
        build_figure(rows, build_spans(rows), x_axis="time")


def test_the_step_log_shortens_long_ids_too() -> None:
    from octavo.tracing.steplog import format_step_log

    text = format_step_log(check_rows(SERVE_ROWS))
    assert LONG_A not in text and "3f2a9…b6c-0:5/5/2*" in text and "77e1d…8c7-0:6/7/2✓" in text


def test_the_story_reads_held_requests_from_the_rows() -> None:
    """An engine that reports "held" (waiting for a prefix block another request computes): the story says so
    from the rows, and the finishing rule it quotes matches them (a: prompt at 1, 2 tokens -> 2; b: 2, 2 -> 3)."""
    from octavo.tracing.story import describe_run

    rows = [row(1, [req("a", "prefill", 4, 6, 4, 0, 1)], 9, arrived=["a", "b"], waiting=1),
            row(2, [req("a", "prefill", 2, 6, 6, 1, 2), req("b", "prefill", 2, 6, 6, 1, 2)], 6),
            row(3, [req("a", "decode", 1, 6, 7, 2, 2), req("b", "decode", 1, 6, 7, 2, 2)], 10, finished=["a", "b"])]
    rows[0]["held"] = ["b"]
    rows = check_rows(rows)
    text = "\n".join(describe_run(rows, build_spans(rows), 4))
    assert "Prompts completed at step 2: seq[a], seq[b]." in text
    assert "1 request (seq[b]) waited 1 step for the prompt prefix seq[a] was computing" in text
    assert "seq[a] completed at step 2 with g = 2 → step 3" in text
