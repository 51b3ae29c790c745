"""Soak: `octavo serve` (a real subprocess, loopback) under a long random mix of clients.

Each request picks at random: a whole (non-streamed) completion, a full stream, a stream cancelled after
1-3 chunks, a raw TCP client that sends its request and hangs up, or a client that times out after
50 ms. Prompts (token ids, 1-80 long) and lengths are random; the KV pool is small, so the engine also
preempts. Afterwards:
- nothing lost, nothing duplicated: every completed request got exactly one response, equal to the
  offline engine's greedy output for its prompt and length, with a finish reason and (streams) one
  [DONE]; response ids are all distinct; the server's finish counters match the client's counts
  (length == completed exactly, abort within [cancelled streams, all hang-ups]);
- nothing leaked: /metrics reports 0 running, 0 waiting and 0 KV usage;
- memory is flat: the server's resident set after the run exceeds its size after warm-up by at most
  RSS_BOUND_MIB (stated bound; measured growth is printed with -s).
Default run: SHORT requests (<~60 s on 2 busy cores). `-m slow`: LONG requests.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from engine_helpers import exported
from test_reliability_shutdown import start_serve

from octavo import LLM, SamplingParams

KEY = "sk-soak"
SHORT, LONG = 800, 5000
CLIENTS = 24
RSS_BOUND_MIB = 16.0  # growth of the server's RSS from warm-up (first 20% of requests) to the end
# (measured 2026-11-29: +0.6 MiB over 800 requests, +2.2 MiB over 5000, from ~104 MiB)
LENGTHS = (1, 5, 12, 24)
LONG_TOKENS = 400  # requests that are cancelled ask for this many (they cannot finish before the hang-up)
KINDS = ("whole", "stream", "cancel", "hangup", "timeout")
WEIGHTS = (35, 35, 10, 10, 10)


@pytest.fixture(scope="module")
def folder(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(octavo:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
        reason = re.search(r'finished_reason="(\w+)"', labels or "")
        out[name + (f"[{reason.group(1)}]" if reason else "")] = float(value)
    return out


def soak(folder: Path, total: int, seed: int, time_limit: float) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randrange(1, 81))] for _ in range(40)]
    llm = LLM(str(folder), num_blocks=1024, num_threads=1)
    refs = {}
    outs = llm.generate([p for p in prompts for _ in LENGTHS],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _ in prompts for m in LENGTHS],
                        use_tqdm=False)
    for k, o in enumerate(outs):
        refs[(k // len(LENGTHS), LENGTHS[k % len(LENGTHS)])] = o.outputs[0].text
    llm.close()
    jobs = [(rng.choices(KINDS, WEIGHTS)[0], rng.randrange(len(prompts)), rng.choice(LENGTHS), rng.randrange(1, 4),
             rng.random()) for _ in range(total)]

    proc, url = start_serve(folder, "--num-blocks", "40", "--block-size", "16", "--max-num-seqs", "16",
                            "--api-key", KEY, "--shutdown-timeout", "5")
    host, port = url.removeprefix("http://").split(":")
    headers = {"Authorization": f"Bearer {KEY}"}
    got: dict[int, tuple[str, str, str | None]] = {}  # job -> (response id, text, finish reason)
    problems: list[str] = []
    done = 0
    warm_rss: list[float] = []

    async def run_job(c: httpx.AsyncClient, i: int) -> None:
        kind, p, m, chunks, frac = jobs[i]
        body = {"model": "tiny", "prompt": prompts[p], "temperature": 0, "ignore_eos": True,
                "max_tokens": m if kind in ("whole", "stream") else LONG_TOKENS}
        if kind == "whole":
            r = await c.post("/v1/completions", json=body)
            if r.status_code != 200:
                problems.append(f"{i}: {r.status_code} {r.text[:200]}")
                return
            d = r.json()
            got[i] = (d["id"], d["choices"][0]["text"], d["choices"][0]["finish_reason"])
            if d["usage"]["completion_tokens"] != m:
                problems.append(f"{i}: usage {d['usage']}")
        elif kind in ("stream", "cancel"):
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    problems.append(f"{i}: {r.status_code}")
                    return
                ids, text, reasons, n, done_marks = set(), "", [], 0, 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done_marks += 1
                        continue
                    ch = json.loads(line[6:])
                    ids.add(ch["id"])
                    text += ch["choices"][0]["text"]
                    if ch["choices"][0]["finish_reason"]:
                        reasons.append(ch["choices"][0]["finish_reason"])
                    n += 1
                    if kind == "cancel" and n >= chunks:
                        return  # leaving the block closes the connection mid-stream
                if len(ids) != 1 or len(reasons) != 1 or done_marks != 1:
                    problems.append(f"{i}: stream ids={ids} reasons={reasons} done={done_marks}")
                    return
                got[i] = (ids.pop(), text, reasons[0])
        elif kind == "hangup":
            reader, writer = await asyncio.open_connection(host, int(port))
            raw = json.dumps(body).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
            await writer.drain()
            await asyncio.sleep(frac * 0.05)
            writer.close()
        else:  # timeout
            try:
                await c.post("/v1/completions", json=body, timeout=0.05)
                problems.append(f"{i}: a {LONG_TOKENS}-token request finished within 50 ms?")
            except httpx.TimeoutException:
                pass

    async def main() -> None:
        nonlocal done
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(total):
            queue.put_nowait(i)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120,
                                     limits=httpx.Limits(max_connections=CLIENTS * 2)) as c:
            async def worker() -> None:
                nonlocal done
                while not queue.empty():
                    i = queue.get_nowait()
                    await run_job(c, i)
                    done += 1
                    if done == total // 5:
                        warm_rss.append(rss_mib(proc.pid))

            await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(CLIENTS)]), time_limit)

    try:
        t0 = time.monotonic()
        asyncio.run(main())
        elapsed = time.monotonic() - t0
        # idle: hang-ups and timeouts are noticed by the server asynchronously
        deadline = time.monotonic() + 20
        while True:
            m = metrics(url)
            if (m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
                    and m["octavo:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        end_rss = rss_mib(proc.pid)
        kinds = Counter(k for k, *_ in jobs)
        print(f"soak: {total} requests {dict(kinds)} in {elapsed:.1f} s; RSS warm {warm_rss[0]:.1f} MiB, "
              f"end {end_rss:.1f} MiB (+{end_rss - warm_rss[0]:.1f}); preemptions {m['octavo:num_preemptions_total']:.0f}")
        assert not problems, problems[:10]
        completed = [i for i, (k, *_) in enumerate(jobs) if k in ("whole", "stream")]
        assert sorted(got) == completed  # none lost
        assert len({rid for rid, _, _ in got.values()}) == len(got)  # none duplicated or crossed
        for i in completed:
            _, p, mt, _, _ = jobs[i]
            rid, text, reason = got[i]
            assert reason == "length" and text == refs[(p, mt)], (i, text, refs[(p, mt)])
        assert m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
        assert m["octavo:kv_cache_usage_perc"] == 0
        assert m["octavo:request_success_total[length]"] == len(completed)
        assert kinds["cancel"] <= m["octavo:request_success_total[abort]"] <= kinds["cancel"] + kinds["hangup"] + kinds["timeout"]
        assert m["octavo:num_preemptions_total"] > 0  # the small pool really was under pressure
        assert end_rss - warm_rss[0] <= RSS_BOUND_MIB, (warm_rss, end_rss)
        assert httpx.get(url + "/health").status_code == 200 and proc.poll() is None
        assert elapsed < time_limit
        proc.send_signal(signal.SIGTERM)  # and after all that, a clean exit
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_soak_short(folder) -> None:  # noqa: ANN001
    soak(folder, SHORT, seed=1, time_limit=90)


@pytest.mark.slow
def test_soak_long(folder) -> None:  # noqa: ANN001
    soak(folder, LONG, seed=2, time_limit=900)
