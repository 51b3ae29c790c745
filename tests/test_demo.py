"""The demo machinery on a small random model (tests/models.py), checked against what must be true.

Every expectation here is computed independently of octavo's code: from the generation lengths, the
prompt lengths and the scheduling rules of DESIGN.md (running requests first, then waiting ones FCFS,
under a token budget; the step that completes a prompt samples its first token).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from octavo.cli import main
from octavo.demo.profiles import Profile
from octavo.demo.run import DemoConfig, run_demo
from octavo.errors import InvalidRequestError
from octavo.tracing.files import write_outputs
from octavo.tracing.reader import check_rows, read_trace
from octavo.tracing.report import format_terminal

BLOCK = 16
# the seed's generation lengths; prompts written like the seed's kinds, each starting differently (no
# prompt shares a full first block with another, so every block belongs to exactly one request)
TEXTS = [
    ("Short answer", "What is 6 times 7?", 4),
    ("Long context", "Once upon a time. " + "The quick brown fox jumps over the lazy dog. " * 8, 8),
    ("Short Q&A", "What is the capital of France?", 16),
    ("Translation", "Translate to French: good morning, how are you today?", 16),
    ("Math problem", "Solve: if x + 3 = 7 then x = 4. Solve: x + 9 = 12.", 24),
    ("Medium Q&A", "Paris is the capital. Why?", 32),
    ("Code generation", "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)", 48),
    ("Long generation", "Héllo wörld, naïve café. Once upon a time there was a small engine.", 48),
    ("Essay", "Write an essay about the history of computing, memory and paging.", 64),
]
MULTI_TURN = (
    {"role": "user", "content": "Hello there, engine!"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Translate to French: good morning."},
)
PROFILES = [Profile(i, kind, ({"role": "user", "content": text},), g) for i, (kind, text, g) in enumerate(TEXTS)]
PROFILES.insert(6, Profile(9, "Multi-turn", MULTI_TURN, 32))
GEN = {p.id: p.max_tokens for p in PROFILES}


@pytest.fixture(scope="module")
def model_dir(hf_model_dir, tmp_path_factory) -> Path:
    from octavo.export import export_model

    out = tmp_path_factory.mktemp("demo_model") / "llama"
    export_model(hf_model_dir("llama"), out, progress=False, overwrite=True)
    return out


@pytest.fixture(scope="module")
def together(model_dir, tmp_path_factory):  # noqa: ANN201
    trace = tmp_path_factory.mktemp("demo_trace") / "together.jsonl"
    return run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK, trace_path=str(trace)), PROFILES), trace


def _finish_steps(rows: list[dict]) -> dict[str, int]:
    return {f["id"]: r["step"] for r in rows for f in r["finished"]}


def _check_blocks(rows: list[dict]) -> None:
    """blocks == ceil(total_len / block_size) while running; free + used == total after every step."""
    for r in rows:
        done = {f["id"] for f in r["finished"]}
        for q in r["requests"]:
            assert q["blocks"] == math.ceil(q["total_len"] / BLOCK), (r["step"], q)
        still_holding = sum(q["blocks"] for q in r["requests"] if q["id"] not in done)
        assert r["free_blocks"] + still_holding == r["total_blocks"], r["step"]
    assert rows[-1]["free_blocks"] == rows[-1]["total_blocks"]  # nothing leaked


def test_together_finishes_at_the_step_its_length_implies(together):
    run, trace = together
    rows = run.rows
    prompt = {r.id: len(r.prompt_ids) for r in run.requests}
    assert sum(prompt.values()) <= 2048  # the default budget: every prompt is prefilled in step 1
    assert [r["step"] for r in rows] == list(range(1, max(GEN.values()) + 1))
    # a request of g tokens: first token sampled in step 1, the g-th in step g
    assert _finish_steps(rows) == GEN
    for rid, out in run.outputs.items():
        assert len(out.outputs[0].token_ids) == GEN[rid] and out.outputs[0].finish_reason == "length"
    for r in rows:
        s = r["step"]
        running = {rid for rid, g in GEN.items() if g >= s}
        assert r["batch_size"] == len(running) == len({q["id"] for q in r["requests"]})
        assert {q["id"] for q in r["requests"]} == running
        assert r["num_tokens"] == (sum(prompt.values()) if s == 1 else len(running))
        for q in r["requests"]:
            assert q["phase"] == ("prefill" if s == 1 else "decode")
            assert q["prompt_len"] == prompt[q["id"]]
            assert q["total_len"] == prompt[q["id"]] + s - 1  # KV of the prompt + the tokens fed back so far
            assert q["output_len"] == s
    _check_blocks(rows)
    # the engine's trace file holds the same rows the step listener saw
    assert read_trace(trace) == check_rows(rows)


def test_together_report_and_files(together, tmp_path):
    run, trace = together
    text = format_terminal(run.report)
    for rid, g in GEN.items():
        assert re.search(rf"^seq\[{rid}\]\s+[▓█]+ ✓{g}$", text, re.M), rid  # timeline row
        assert re.search(rf"^{rid}\s+.*\b{g} tok\b.*step {g}$", text, re.M), rid  # table row
    assert re.search(r"step\s+4: seq\[0\] leaves \(length\)\s+batch 10 → 9", text)
    mean = sum(GEN.values()) / len(GEN)
    assert f"on average after {mean:.1f} steps" in text and f"all {max(GEN.values())} steps" in text
    # memory: per-request slots and unused tail, measured from the rows
    for m in run.report.memory.requests:
        assert m.slots == math.ceil(m.tokens / BLOCK) * BLOCK and 0 <= m.unused < BLOCK
    # every request's answer is printed under its label
    answers = text.split("=== Answers ")[1]
    for p in PROFILES:
        assert f"seq[{p.id}] {p.kind} [{p.max_tokens} tok]" in answers
    # PNG and HTML drawn from the trace file
    from octavo.tracing.report import build_report

    report = build_report(read_trace(trace), labels={p.id: p.kind for p in PROFILES})
    png, html = write_outputs(report, png=tmp_path / "d.png", html=tmp_path / "d.html")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "data:image/png;base64," in html.read_text() and "seq[8]" in html.read_text()


def test_answers_match_transformers_greedy(together, hf_model_dir):
    from models import hf_greedy, load_hf

    run, _ = together
    model, _tok = load_hf(hf_model_dir("llama"))
    for req in run.requests[:2] + run.requests[-1:]:
        want = hf_greedy(model, req.prompt_ids, req.max_tokens)
        assert run.outputs[req.id].outputs[0].token_ids == want, req.kind


def _simulate(prompts: list[int], gens: list[int], budget: int) -> tuple[list[int], list[int], list[int]]:
    """DESIGN.md's scheduling on an unlimited pool: finish step per request, tokens and batch per step."""
    n = len(prompts)
    computed, out, finish = [0] * n, [0] * n, [0] * n
    running: list[int] = []
    waiting = list(range(n))
    tokens, batch = [], []
    step = 0
    while running or waiting:
        step += 1
        left, sched = budget, {}
        for i in running:  # running first: the next chunk or one decode token
            if left == 0:
                break
            sched[i] = min(prompts[i] + out[i] - computed[i], left)
            left -= sched[i]
        while waiting and left:  # then waiting, first come first served, a chunk if the budget is short
            i = waiting.pop(0)
            sched[i] = min(prompts[i] - computed[i], left)
            left -= sched[i]
            running.append(i)
        for i, k in sched.items():
            computed[i] += k
            if computed[i] == prompts[i] + out[i]:  # all its tokens are in the cache: sample the next
                out[i] += 1
                if out[i] == gens[i]:
                    finish[i] = step
                    running.remove(i)
        tokens.append(sum(sched.values()))
        batch.append(len(sched))
    return finish, tokens, batch


def test_small_budget_prefills_in_chunks(model_dir):
    budget = 48
    run = run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK, max_num_batched_tokens=budget), PROFILES)
    prompts = [len(r.prompt_ids) for r in run.requests]
    assert max(prompts) > budget  # the long prompt needs several chunks
    finish, tokens, batch = _simulate(prompts, [r.max_tokens for r in run.requests], budget)
    assert _finish_steps(run.rows) == {r.id: f for r, f in zip(run.requests, finish)}
    assert [r["num_tokens"] for r in run.rows] == tokens
    assert [r["batch_size"] for r in run.rows] == batch
    assert all(r["num_tokens"] <= budget for r in run.rows)
    long_id = run.requests[prompts.index(max(prompts))].id
    chunks = [q for r in run.rows for q in r["requests"] if q["id"] == long_id and q["phase"] == "prefill"]
    assert len(chunks) > 1 and sum(q["tokens"] for q in chunks) == max(prompts)
    _check_blocks(run.rows)


def test_staggered_arrivals_join_mid_stream(model_dir, tmp_path):
    every = 3
    run = run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK, arrivals="staggered", stagger_every=every,
                              trace_path=str(tmp_path / "s.jsonl")), PROFILES)
    rows = {r["step"]: r for r in run.rows}
    arrive = {p.id: 1 + i * every for i, p in enumerate(PROFILES)}
    finish = {rid: arrive[rid] + GEN[rid] - 1 for rid in GEN}
    assert _finish_steps(run.rows) == finish
    for s, r in rows.items():
        live = {rid for rid in GEN if arrive[rid] <= s <= finish[rid]}
        assert live, f"no request at step {s}: the test's arrivals must keep the engine busy"
        assert {q["id"] for q in r["requests"]} == live and r["batch_size"] == len(live)
        assert set(r["arrived"]) == {rid for rid in GEN if arrive[rid] == s}
    for rid, a in arrive.items():
        first = next(q for q in rows[a]["requests"] if q["id"] == rid)
        assert first["phase"] == "prefill"
        if a > 1:  # joins a batch that is already decoding
            assert any(q["phase"] == "decode" for q in rows[a]["requests"] if q["id"] != rid)
    _check_blocks(run.rows)
    text = format_terminal(run.report, step_log=False)
    assert re.search(r"step\s+4: seq\[1\] joins; seq\[0\] leaves \(length\)\s+batch 1 → 2 → 1", text)


def test_small_pool_preempts_and_still_answers_exactly(model_dir, together):
    full, _ = together
    need = {r.id: math.ceil((len(r.prompt_ids) + r.max_tokens) / BLOCK) for r in full.requests}
    blocks = max(max(need.values()) + 2, sum(need.values()) // 2)
    run = run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK, num_blocks=blocks), PROFILES)
    assert sum(len(r["preempted"]) for r in run.rows) > 0
    assert all(r["total_blocks"] == blocks for r in run.rows)
    for rid, out in run.outputs.items():  # greedy: preemption and recompute never change the answer
        assert out.outputs[0].token_ids == full.outputs[rid].outputs[0].token_ids
    _check_blocks(run.rows)
    assert "✗" in format_terminal(run.report, step_log=False)


def test_demo_command_on_any_model(model_dir, tmp_path, capsys):
    rc = main(["demo", "--model", str(model_dir), "--trace", str(tmp_path / "t.jsonl"), "--png",
               str(tmp_path / "t.png"), "--html", str(tmp_path / "t.html"), "--block-size", "32"])
    out = capsys.readouterr().out
    assert rc == 0
    for heading in ("Requests", "Per-step log", "Timeline", "KV memory, measured", "Answers"):
        assert f"=== {heading} " in out
    assert "ignore_eos=True" in out and re.search(r"^seq\[7\]\s+▓█+ ✓64$", out, re.M)  # the seed profiles: seq 7 is the essay
    assert read_trace(tmp_path / "t.jsonl")[0]["block_size"] == 32
    assert (tmp_path / "t.png").stat().st_size > 20_000 and (tmp_path / "t.html").is_file()
    rc = main(["trace", str(tmp_path / "t.jsonl"), "--no-log"])
    assert rc == 0 and "✓64" in capsys.readouterr().out


@pytest.mark.slow
def test_octavo_demo_smollm2_end_to_end(tmp_path):
    """The README's command on the real default model: export (cached), ten requests, table, log, timeline, PNG."""
    env = dict(os.environ, OCTAVO_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "octavo", "demo", "--trace", str(tmp_path / "t.jsonl"),
           "--png", str(tmp_path / "demo.png"), "--html", str(tmp_path / "demo.html")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for heading in ("Requests", "Per-step log", "Timeline", "KV memory, measured", "Answers"):
        assert f"=== {heading} " in out
    seed = {"6": 4, "4": 8, "2": 16, "9": 16, "8": 24, "3": 32, "11": 32, "5": 48, "10": 48, "7": 64}
    rows = read_trace(tmp_path / "t.jsonl")
    done = {}
    for r in rows:  # the step that completed each prompt
        for q in r["requests"]:
            if q["phase"] == "prefill" and q["id"] not in done or (q["phase"] == "prefill" and done[q["id"]] == r["step"] - 1):
                done[q["id"]] = r["step"]
    for rid, g in seed.items():  # the step completing a prompt samples its first token
        assert re.search(rf"^seq\[{rid}\]\s+[░▓]*▓█+ ✓{done[rid] + g - 1}$", out, re.M), rid
    # at block size 16 the chat template's system prompt fills a block: one request computes it, the others wait
    # one step and read it from the prefix cache; the header says so instead of "every prompt in step 1"
    first = sorted(rid for rid, step in done.items() if step == 1)
    assert f"Prompts completed at step 1: {', '.join(f'seq[{i}]' for i in first)}" in out or len(first) == 10
    assert "Step 1 prefilled every prompt" not in out or len(first) == 10
    assert "Paris" in out  # the short Q&A, answered by the real model
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (tmp_path / "demo.html").read_text()
    assert len(rows) == max(done[rid] + g - 1 for rid, g in seed.items())


SHARED = "You are a careful assistant. Answer in one short sentence, please. "  # > one 16-token block
SHARED_PROFILES = [Profile(i, kind, ({"role": "user", "content": SHARED + text},), g)
                   for i, (kind, text, g) in enumerate(TEXTS[:5])]


def _prompt_done(rows: list[dict]) -> dict[str, int]:
    """The step that completed each prompt: its last prefill step before it decodes."""
    done: dict[str, int] = {}
    decoding: set[str] = set()
    for r in rows:
        for q in r["requests"]:
            if q["phase"] == "decode":
                decoding.add(q["id"])
            elif q["id"] not in decoding:
                done[q["id"]] = r["step"]
    return done


def _story(run) -> str:  # noqa: ANN001
    from octavo.tracing.story import describe_run

    return "\n".join(describe_run(run.rows, run.report.spans, 2048))


def test_the_story_says_every_prompt_went_in_step_1_only_when_it_did(together):
    run, _ = together
    assert set(_prompt_done(run.rows).values()) == {1}
    text = _story(run)
    assert f"Step 1 prefilled every prompt, {run.rows[0]['num_tokens']} tokens" in text
    assert "finished at step 1 + g - 1 = g" in text


def test_the_story_tells_a_held_shared_prefix_as_it_happened(model_dir):
    """Issue 20.1: prompts sharing a full first block (the chat template's system prompt at block size 16) are not
    all prefilled in step 1: one computes the block, the others wait a step and read it from the prefix cache.
    The sentences must say that, and the finishing steps they quote must be the trace's."""
    run = run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK), SHARED_PROFILES)
    done = _prompt_done(run.rows)
    finished = _finish_steps(run.rows)
    first = sorted((rid for rid, step in done.items() if step == 1), key=int)
    later = sorted((rid for rid, step in done.items() if step > 1), key=int)
    assert first and later, done  # the premise: the shared block held the others back
    text = _story(run)
    assert "Step 1 prefilled every prompt" not in text
    assert text.startswith(f"Prompts completed at step 1: {', '.join(f'seq[{i}]' for i in first)}; step 2:"), text
    assert f"waited 1 step for the prompt prefix seq[{first[0]}] was computing" in text
    for p in SHARED_PROFILES:  # the rule the text states holds for every request
        assert finished[p.id] == done[p.id] + p.max_tokens - 1
    for rid, g in ((first[0], GEN[first[0]]), (later[0], GEN[later[0]])):  # and the examples it quotes are real
        assert f"seq[{rid}] completed at step {done[rid]} with g = {g} → step {finished[rid]}" in text


def test_the_story_names_chunked_prefills(model_dir):
    run = run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK, max_num_batched_tokens=48), PROFILES)
    chunked = [s.id for s in run.report.spans if s.prefill_steps > 1]
    assert chunked
    from octavo.tracing.story import describe_run

    text = "\n".join(describe_run(run.rows, run.report.spans, 48))
    assert "Prefilled in chunks (the step budget of 48 is shared)" in text and f"seq[{chunked[0]}] in " in text
    done = _prompt_done(run.rows)
    for rid, step in _finish_steps(run.rows).items():
        assert step == done[rid] + GEN[rid] - 1


def test_the_story_names_the_long_prefill_cap_when_it_chunked_a_prompt(model_dir):
    """A prompt longer than long_prefill_token_threshold is chunked although the step budget has room: the
    sentence must name the cap, not only the budget (issue 20.1: the text says what the run did)."""
    from octavo.tracing.story import describe_run

    cap = 8
    run = run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK,
                              engine_extra={"long_prefill_token_threshold": cap}), PROFILES)
    chunked = [s for s in run.report.spans if s.prefill_steps > 1]
    assert chunked  # the premise: the budget (2048) fits every prompt, the cap does not
    per_step = [q["tokens"] for r in run.rows for q in r["requests"] if q["phase"] == "prefill"]
    assert max(per_step) <= cap
    text = "\n".join(describe_run(run.rows, run.report.spans, 2048, cap))
    assert f"(the step budget of 2048 is shared, and a prompt gets at most {cap} tokens a step)" in text


def test_float16_kv_cache_halves_the_reported_bytes(model_dir, together):
    """--kv-cache-dtype float16 reaches the engine: the memory report prices a slot at half the bytes, and
    the run keeps the same schedule (the same requests finish at the same steps)."""
    run16 = run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK, kv_cache_dtype="float16"), PROFILES)
    run32, _ = together
    assert run16.report.memory.bytes_per_slot * 2 == run32.report.memory.bytes_per_slot
    assert _finish_steps(run16.rows) == _finish_steps(run32.rows)
    _check_blocks(run16.rows)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):  # the engine itself sees the setting
        run_demo(DemoConfig(model=str(model_dir), block_size=BLOCK, kv_cache_dtype="float8"), PROFILES)
