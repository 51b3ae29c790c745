"""The SLO-capacity measurement (benchmarks/slo_capacity.py, benchmarks/slo/) on the tiny model.

Not a speed test: what must hold is that the numbers are measured. With a loose SLO the search finds
a capacity on `octavo serve` and on the HF naive server, every request of every point completed and
its latencies are real (TTFT below E2E, TPOT from the server's token count); with an impossibly tight
SLO the same servers miss it at the first rate, the point stops early and the server is idle again
after it. The naive server is checked against transformers' own greedy `generate` (same tokens) and
for running one request at a time (its gauges show one running and one waiting), and the replay that
estimates it below its measurable range against a queue worked out by hand.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.peers.online import free_port, server_process
from benchmarks.slo import engines
from benchmarks.slo.fifo_replay import replay
from benchmarks.slo.point import Server, measure_point
from benchmarks.slo.run import EngineResult, RunOptions, measure_server
from benchmarks.slo.search import SearchPlan, search
from benchmarks.slo.table import format_table
from benchmarks.slo.target import Slo
from benchmarks.slo.workload import ChatShape, allowed_ids, point_requests
from octavo.bench.report import RequestResult

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ChatShape(num_requests=6, prompt=(8, 24), output=(4, 12), seed=3)
LOOSE = Slo(ttft_s=120.0, tpot_s=30.0)
IMPOSSIBLE = Slo(ttft_s=1e-6, tpot_s=1e-6)


def _serve(spec: engines.EngineSpec, port: int):  # noqa: ANN202
    url = f"http://127.0.0.1:{port}"
    return server_process(spec.argv, url, timeout_s=300, env=spec.env), url


@pytest.fixture(scope="module")
def model(hf_model_dir) -> str:  # noqa: ANN001
    return str(hf_model_dir("llama"))


@pytest.fixture(scope="module", params=[engines.OCTAVO, engines.NAIVE])
def server(request, model: str):  # noqa: ANN001, ANN201
    port = free_port()
    spec = (engines.octavo_engine(model, port, 2) if request.param == engines.OCTAVO
            else engines.naive_engine(model, port, 2))
    ctx, url = _serve(spec, port)
    with ctx:
        model_id = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield request.param, spec.name, Server(url, model_id, spec.busy_gauges)


def _busy(server: Server) -> float:
    from benchmarks.slo.point import busy

    async def go() -> float:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            return await busy(s, server)

    return asyncio.run(go())


def test_loose_slo_finds_a_capacity_from_measured_points(server, model: str) -> None:  # noqa: ANN001
    kind, name, srv = server
    res = EngineResult(name)
    opts = RunOptions(max_points=2, start_rate=20.0, max_point_s=60.0)
    measure_server(res, srv, SHAPE, allowed_ids(model), LOOSE, opts, one_at_a_time=kind == engines.NAIVE)
    cap = res.capacity
    assert res.alone_e2e_s >= res.alone_ttft_s > 0  # equal when the whole answer came in one chunk (deltas coalesce)
    assert [p.rate for p in cap.points] == [20.0, 40.0]  # both met the loose SLO: the search went up
    assert cap.best is cap.points[-1] and cap.lowest_miss is None and "capacity >=" in cap.note
    want_tokens = sum(o for _, o in SHAPE.lengths())
    for p in cap.points:
        assert p.meets_slo and not p.stopped_early and not p.estimated
        assert p.completed == p.sent == SHAPE.num_requests and p.failed == 0
        assert p.output_tokens == want_tokens  # the server's own usage counts: every token was generated
        assert 0 < p.ttft_p50 <= p.ttft_p99 and p.e2e_mean > 0
        # a request whose tokens all came in one streamed chunk (the server coalesces deltas the client has
        # not read yet, as vLLM's does) has a TPOT of 0 as a client sees it: >= 0, never above the SLO
        assert 0 <= p.tpot_p50 <= p.tpot_p99 <= LOOSE.tpot_s
        assert p.users == pytest.approx(p.rate * p.e2e_mean)
    if kind == engines.NAIVE:  # the replay of its requests alone, beside the points measured
        assert res.estimate is not None and res.estimate.best is not None and res.estimate.best.estimated
        assert len(res.replay_checks) == 2
    table = format_table([res], name if kind == engines.NAIVE else None)
    assert f"| {name} | >=40" in table


def test_impossible_slo_is_missed_and_the_point_stops_early(server, model: str) -> None:  # noqa: ANN001
    kind, _, srv = server
    requests = point_requests(SHAPE, 7, allowed_ids(model))
    p = asyncio.run(measure_point(srv, requests, 5.0, IMPOSSIBLE, seed=SHAPE.seed))
    assert not p.meets_slo and p.stopped_early
    need = IMPOSSIBLE.violations_to_fail(SHAPE.num_requests)
    assert p.completed + p.failed >= need
    assert "over the TTFT limit" in p.why
    assert p.ttft_p99 > 0  # the requests that finished were measured
    assert _busy(srv) == 0  # the cancelled ones are gone: the next point starts on an idle server
    # the same rate with a loose SLO meets it: the verdict comes from the limits, not from the rate
    assert asyncio.run(measure_point(srv, requests, 5.0, LOOSE, seed=SHAPE.seed)).meets_slo


def test_search_without_a_passing_rate_reports_a_bound(server, model: str) -> None:  # noqa: ANN001
    _, _, srv = server
    ids = allowed_ids(model)
    counter = iter(range(100))
    cap = search(lambda r: asyncio.run(measure_point(srv, point_requests(SHAPE, next(counter), ids), r, IMPOSSIBLE)),
                 SearchPlan(start_rate=4.0, min_rate=1.5, max_points=5))
    assert [p.rate for p in cap.points] == [4.0, 2.0]  # 1.0 would be below min_rate
    assert cap.best is None and cap.lowest_miss == 2.0
    assert "capacity < 2" in cap.note and "lowest rate" in cap.note


def test_violations_to_fail_settles_the_percentile() -> None:
    rng = np.random.default_rng(0)
    slo = Slo(1.0, 1.0, 99.0)
    for n in range(2, 130):
        need = slo.violations_to_fail(n)
        for _ in range(5):  # `need` values over the limit: the percentile is over it, whatever the rest
            x = np.concatenate([1.0 + rng.random(need), rng.random(n - need) * 2])
            assert np.percentile(x, 99) > 1.0, n
        # one fewer, just over the limit, the rest far under it: the percentile can still be within it
        x = np.concatenate([np.full(need - 1, 1.0 + 1e-9), np.zeros(n - need + 1)])
        assert np.percentile(x, 99) <= 1.0, n


def _alone(ttft: float, e2e: float, tokens: int) -> RequestResult:
    return RequestResult(success=True, prompt_len=8, output_len=tokens, ttft=ttft, latency=e2e)


def test_fifo_replay_is_a_one_at_a_time_queue() -> None:
    alone = [_alone(0.1 * (i + 1), 1.0 + 0.1 * i, 11) for i in range(8)]
    slow = replay(alone, 1e-6, LOOSE)  # arrivals far apart: nobody waits
    assert slow.ttft_p99 == pytest.approx(np.percentile([r.ttft for r in alone], 99))
    assert slow.tpot_p50 == pytest.approx(np.median([(r.latency - r.ttft) / 10 for r in alone]))
    burst = replay(alone, 1e9, LOOSE)  # all at once: request i waits for every one before it
    waits = np.cumsum([0.0] + [r.latency for r in alone[:-1]])
    want = np.array([r.ttft for r in alone]) + waits
    assert burst.ttft_p99 == pytest.approx(np.percentile(want, 99), rel=1e-6)
    assert burst.e2e_mean == pytest.approx(np.mean(waits + [r.latency for r in alone]), rel=1e-6)
    slo = Slo(ttft_s=2.0, tpot_s=1.0)
    cap = search(lambda r: replay(alone, r, slo), SearchPlan(start_rate=1.0, max_points=60, precision=0.01))
    assert cap.best is not None and cap.best.meets_slo and cap.lowest_miss <= cap.best.rate * 1.01
    assert not replay(alone, cap.lowest_miss, slo).meets_slo


def test_naive_server_is_transformers_greedy_one_request_at_a_time(model: str) -> None:
    import torch
    import transformers

    port = free_port()
    spec = engines.naive_engine(model, port, 2)
    ctx, url = _serve(spec, port)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    prompt = [5, 17, 42, 99, 7, 250, 31]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    with ctx:
        body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["token_ids"] == want and got["usage"]["completion_tokens"] == 12
        bad = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0.7}, timeout=60)
        assert bad.status_code == 400 and "greedily" in bad.json()["error"]["message"]
        too_long = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 10**6}, timeout=60)
        assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
        srv = Server(url, "m", spec.busy_gauges)
        long = {**body, "max_tokens": 900, "stream": True}
        with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2, \
                c1.stream("POST", f"{url}/v1/completions", json=long) as first, \
                c2.stream("POST", f"{url}/v1/completions", json=long) as second:
            assert first.status_code == second.status_code == 200
            deadline = time.monotonic() + 60
            while _gauges(url) != (1.0, 1.0):  # one runs, the other waits for it
                assert time.monotonic() < deadline, _gauges(url)
            chunk = json.loads(next(first.iter_lines()).removeprefix("data: "))
            assert len(chunk["choices"][0]["token_ids"]) == 1  # one token per chunk
        deadline = time.monotonic() + 60
        while _busy(srv) > 0:  # both clients gone: the running job stops and the queued one never starts
            assert time.monotonic() < deadline, _gauges(url)


def _gauges(url: str) -> tuple[float, float]:
    vals = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("hf_naive:"):
            vals[name] = float(value)
    return vals["hf_naive:num_requests_running"], vals["hf_naive:num_requests_waiting"]


@pytest.mark.slow  # the in-process tests above cover the same path; this is the script's own argv and JSON
def test_script_runs_end_to_end(model: str, tmp_path: Path) -> None:
    out = tmp_path / "slo.json"
    cmd = [sys.executable, "-m", "benchmarks.slo_capacity", "--model", model,
           "--engines", "octavo,hf-naive,vllm",
           "--requests", "4", "--prompt-len", "8,16", "--output-len", "4,8", "--max-points", "2", "--start-rate", "20",
           "--slo-ttft-ms", "120000", "--slo-tpot-ms", "30000", "--vllm-python", str(tmp_path / "no-venv" / "python"),
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [e["engine"] for e in report["engines"]] == ["octavo serve", "HF naive (one at a time)"]
    assert all(e["error"] is None and e["capacity"]["rate"] == 40.0 for e in report["engines"])
    assert any("vLLM not run" in n for n in report["notes"])
    assert "| octavo serve | >=40 |" in proc.stdout and "p99 of each point is over its 4 requests" in proc.stdout


def test_table_ratios_keep_bounds_and_estimates() -> None:
    from benchmarks.slo.search import Capacity
    from benchmarks.slo.target import PointResult

    def engine(name: str, rate: float | None, miss: float | None, est: float | None = None) -> EngineResult:
        met = PointResult(rate or 1.0, 8, completed=8, sent=8, meets_slo=rate is not None, e2e_mean=2.0,
                          ttft_p50=0.1, ttft_p99=0.2, tpot_p50=0.01, tpot_p99=0.02)
        missed = PointResult(miss, 8, sent=2, stopped_early=True) if miss else None
        cap = Capacity([p for p in (met if rate else None, missed) if p], met if rate else None, miss)
        res = EngineResult(name, capacity=cap)
        if est is not None:
            e = PointResult(est, 8, completed=8, sent=8, meets_slo=True, e2e_mean=1.0, estimated=True)
            res.estimate = Capacity([e], e, est * 1.01)
        return res

    naive_measured = engine("naive", 0.5, 1.0)
    table = format_table([engine("a", 2.0, 2.2), engine("b", 4.0, None), engine("c", None, 0.25), naive_measured],
                         "naive")
    assert "| a | 2 | 4.00 | 100 / 200 | 10 / 20 | 4.00x |" in table  # users = 2 req/s x 2 s
    assert "| b | >=4 |" in table and ">= 8.00x" in table
    assert "| c | <0.25 | - | - | - | < 0.50x |" in table
    assert "| naive | 0.5 | 1.00 | 100 / 200 | 10 / 20 | 1.00x |" in table
    est = format_table([engine("a", 2.0, 2.2), engine("naive", None, 0.25, est=0.02)], "naive")
    assert "| naive | ~0.02 | ~0.02 |" in est and "~100.00x" in est
