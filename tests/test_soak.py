"""Soak: `octavo serve` (a real subprocess, loopback) under a long random mix of clients.

Each request picks at random: a whole (non-streamed) completion, a full stream, a stream cancelled after
1-3 chunks, a raw TCP client that sends its request and hangs up, or a client that times out after
50 ms. Prompts (token ids, 1-80 long) and lengths are random; the KV pool is small, so the engine also
preempts. Afterwards:
- nothing lost, nothing duplicated: every completed request got exactly one response, equal to the
  offline engine's greedy output for its prompt and length, with a finish reason and (streams) one
  [DONE]; response ids are all distinct; the server's finish counters match the client's counts
  (length == completed, plus at most the abandoned requests the engine ran out, see below; abort within
  [cancelled streams, all hang-ups]);
- nothing computed for nobody: an abandoned request (hang-up, time-out, cancelled stream) may run out only
  if it had (nearly) finished when its client left. The engine's step trace says, per request, how many
  tokens it had when; each one it ran out is matched to its client (prompt length, max_tokens, times) and
  may have computed at most GRACE_TOKENS after that client left. (The server is fast: a 400-token request
  alone takes ~0.2 s, while a loaded client took up to ~1.3 s from sending to leaving, mostly the 50 ms
  httpx time-out, which applies to each phase and fires late when its event loop is busy. So a few
  abandoned requests legitimately run out first; a server that ignored disconnects would compute nearly
  all of their tokens after the client left.)
- nothing leaked: /metrics reports 0 running, 0 waiting and 0 KV usage;
- memory is flat: the server's resident set after the run exceeds its size after warm-up by at most
  RSS_BOUND_MIB (stated bound; measured growth is printed with -s).
Default run: SHORT requests (<~60 s on 2 busy cores). `-m slow`: LONG requests.

The neighbours soak (below) runs ordinary clients beside slowloris connections (never finishing a request,
cut by --header-timeout and replaced) and, in its second form, streams whose clients never read.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import select
import socket
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from engine_helpers import exported
from serve_process import until_idle
from test_reliability_shutdown import start_serve

from octavo import LLM, SamplingParams

KEY = "sk-soak"
SHORT, LONG = 800, 5000
CLIENTS = 24
RSS_BOUND_MIB = 16.0  # growth of the server's RSS from warm-up (first 20% of requests) to the end
# (measured 2026-11-29: +0.6 MiB over 800 requests, +2.2 MiB over 5000, from ~104 MiB)
LENGTHS = (1, 5, 12, 24)
LONG_TOKENS = 400  # abandoned requests ask for LONG_TOKENS - (job % 64) (the spread tells them apart in the trace)
GRACE_TOKENS = LONG_TOKENS // 4  # tokens an abandoned request may still compute after its client left
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


def ran_out_report(trace: Path, jobs: list[tuple], prompts: list[list[int]],
                   left: dict[int, tuple[float, float]]) -> list[dict]:
    """Every request of an abandoned kind that the engine ran out ("length"), matched to its client job:
    how many tokens it computed after that client had left."""
    history: dict[str, list[tuple[float, int]]] = {}
    prompt_len: dict[str, int] = {}
    ran_out: dict[str, float] = {}
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        for r in row["requests"]:
            history.setdefault(r["id"], []).append((row["time"], r["output_len"]))
            prompt_len[r["id"]] = r["prompt_len"]
        for f in row["finished"]:
            if f["reason"] == "length":
                ran_out[f["id"]] = row["time"]
    out = []
    for rid, t_end in ran_out.items():
        n = history[rid][-1][1]
        if n <= max(LENGTHS):
            continue  # a whole or stream request
        t_first = history[rid][0][0]
        cands = [i for i, (t_sent, _) in left.items() if len(prompts[jobs[i][1]]) == prompt_len[rid]
                 and LONG_TOKENS - i % 64 == n and t_sent <= t_first]
        entry = {"id": rid, "tokens": n, "ran_s": round(t_end - t_first, 3), "job": None, "after_left": n}
        if cands:
            i = max(cands, key=lambda j: left[j][0])  # the latest one sent before it was first scheduled
            t_left = left[i][1]
            before = max((k for t, k in history[rid] if t <= t_left), default=0)
            entry.update(job=i, kind=jobs[i][0], after_left=n - before, left_s=round(t_left - t_end, 3))
        out.append(entry)
    return out


def soak(folder: Path, total: int, seed: int, time_limit: float, trace: Path) -> None:
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

    proc, url = start_serve(folder, "--trace", str(trace), "--num-blocks", "40", "--block-size", "16", "--max-num-seqs", "16",
                            "--api-key", KEY, "--shutdown-timeout", "5")
    host, port = url.removeprefix("http://").split(":")
    headers = {"Authorization": f"Bearer {KEY}"}
    got: dict[int, tuple[str, str, str | None]] = {}  # job -> (response id, text, finish reason)
    left: dict[int, tuple[float, float]] = {}  # abandoned job -> (time.time() sent, time.time() it left)
    problems: list[str] = []
    done = 0
    warm_rss: list[float] = []

    async def run_job(c: httpx.AsyncClient, i: int) -> None:
        kind, p, m, chunks, frac = jobs[i]
        body = {"model": "tiny", "prompt": prompts[p], "temperature": 0, "ignore_eos": True,
                "max_tokens": m if kind in ("whole", "stream") else LONG_TOKENS - i % 64}
        t_sent = time.time()
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
                        break  # leaving the block closes the connection mid-stream
            if kind == "cancel":
                left[i] = (t_sent, time.time())
                return
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
            left[i] = (t_sent, time.time())
        else:  # timeout
            try:
                r = await c.post("/v1/completions", json=body, timeout=0.05)
                # answered before the time-out fired: fine if it really ran out (the report below checks it)
                if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] != "length":
                    problems.append(f"{i}: a time-out client got {r.status_code} {r.text[:200]}")
                left[i] = (t_sent, time.time())
            except httpx.TimeoutException:
                left[i] = (t_sent, time.time())

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
        m = until_idle(lambda: metrics(url), 20, 0.1)
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
        late = ran_out_report(trace, jobs, prompts, left)
        print(f"abandoned requests the engine ran out: {late}")
        wasted = [e for e in late if e["after_left"] > GRACE_TOKENS]
        assert not wasted, f"{len(wasted)} abandoned requests computed after their client left: {wasted[:10]}"
        extra = m["octavo:request_success_total[length]"] - len(completed)
        assert 0 <= extra <= len(late), (m["octavo:request_success_total[length]"], len(completed), late)
        late_cancels = sum(1 for e in late if e.get("kind") == "cancel")
        assert (kinds["cancel"] - late_cancels <= m["octavo:request_success_total[abort]"]
                <= kinds["cancel"] + kinds["hangup"] + kinds["timeout"])
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


def test_soak_short(folder, tmp_path) -> None:  # noqa: ANN001
    soak(folder, SHORT, seed=1, time_limit=90, trace=tmp_path / "trace.jsonl")


@pytest.mark.slow
def test_soak_long(folder, tmp_path) -> None:  # noqa: ANN001
    soak(folder, LONG, seed=2, time_limit=900, trace=tmp_path / "trace.jsonl")


# ------------------------------------------------------------------------------------------------------
# hostile neighbours: idle and half-open connections, slow readers, beside ordinary clients

NEIGHBOUR_REQUESTS = 240  # ordinary requests, from NEIGHBOUR_CLIENTS clients
NEIGHBOUR_CLIENTS = 8
IDLE = 48  # connections kept open at once that never finish a request (the server cuts them at 1 s)
SLOW_READERS = 4  # streams (n=4, logprobs 5, 1000 tokens: ~4 MB of events each) whose client never reads
NEIGHBOUR_RSS_BOUND_MIB = 16.0  # as the soak above; measured: +0.5 MiB with idle connections only; with 4 slow
# readers +11 MiB (their coalesced unread output, bounded by max_tokens), +24 MiB with the queue it replaced


def _idle_connections(host: str, port: int, stop: threading.Event, stats: Counter) -> None:
    """Keep IDLE connections open that send nothing, or half a request line, or headers without the blank
    line; each one the server closes (header timeout) is replaced: a churn of slowloris clients."""
    conns: list[socket.socket] = []
    payloads = (b"", b"POST /v1/completions HTT", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")
    try:
        while not stop.is_set():
            while len(conns) < IDLE and not stop.is_set():
                s = socket.create_connection((host, port), timeout=30)
                s.setblocking(False)
                s.sendall(payloads[stats["opened"] % len(payloads)])
                stats["opened"] += 1
                conns.append(s)
            ready, _, _ = select.select(conns, [], [], 0.1)
            for s in ready:
                try:
                    data = s.recv(4096)
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                if not data:  # closed by the server
                    stats["closed_by_server"] += 1
                    conns.remove(s)
                    s.close()
    finally:
        for s in conns:
            s.close()


def _slow_reader(host: str, port: int, stop: threading.Event) -> None:
    """A streaming request with a big output whose client never reads (a tiny receive window)."""
    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
                       "stream": True, "n": 4, "logprobs": 5}).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        stop.wait(600)
    finally:
        s.close()


def neighbours_soak(folder: Path, slow_readers: int, tmp_path: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randrange(1, 60))] for _ in range(12)]
    llm = LLM(str(folder), num_blocks=1024, num_threads=1)
    outs = llm.generate([p for p in prompts for _ in LENGTHS],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _ in prompts for m in LENGTHS],
                        use_tqdm=False)
    refs = {(k // len(LENGTHS), LENGTHS[k % len(LENGTHS)]): o.outputs[0].text for k, o in enumerate(outs)}
    llm.close()
    jobs = [(rng.randrange(len(prompts)), rng.choice(LENGTHS), rng.random() < 0.5) for _ in range(NEIGHBOUR_REQUESTS)]
    proc, url = start_serve(folder, "--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "16",
                            "--api-key", KEY, "--header-timeout", "1", "--max-connections", "256")
    host, port = url.removeprefix("http://").split(":")
    headers = {"Authorization": f"Bearer {KEY}"}
    problems: list[str] = []
    served = 0

    async def run_job(c: httpx.AsyncClient, i: int) -> None:
        nonlocal served
        p, mt, stream = jobs[i]
        body = {"model": "tiny", "prompt": prompts[p], "max_tokens": mt, "ignore_eos": True, "temperature": 0}
        if stream:
            text, reason = "", None
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for ln in r.aiter_lines():
                    if ln.startswith("data: ") and ln != "data: [DONE]":
                        ch = json.loads(ln[6:])["choices"][0]
                        text += ch["text"]
                        reason = ch["finish_reason"] or reason
        else:
            r = await c.post("/v1/completions", json=body)
            if r.status_code != 200:
                problems.append(f"job {i}: {r.status_code} {r.text[:200]}")
                return
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        if text != refs[(p, mt)] or reason != "length":
            problems.append(f"job {i}: {text!r} != {refs[(p, mt)]!r} ({reason})")
        served += 1

    async def clients(js: list[int]) -> None:
        queue = list(js)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
            async def worker() -> None:
                while queue:
                    await run_job(c, queue.pop())
            await asyncio.gather(*[worker() for _ in range(NEIGHBOUR_CLIENTS)])

    stop = threading.Event()
    stats: Counter = Counter()
    threads = [threading.Thread(target=_idle_connections, args=(host, int(port), stop, stats), daemon=True)]
    threads += [threading.Thread(target=_slow_reader, args=(host, int(port), stop), daemon=True)
                for _ in range(slow_readers)]
    try:
        warm = NEIGHBOUR_REQUESTS // 5
        asyncio.run(clients(list(range(warm))))
        warm_rss = rss_mib(proc.pid)
        for t in threads:
            t.start()
        asyncio.run(clients(list(range(warm, NEIGHBOUR_REQUESTS))))
        deadline = time.monotonic() + 120
        peak_rss = rss_mib(proc.pid)
        while slow_readers and metrics(url)["octavo:num_requests_running"] > 0:  # the slow readers' engine work
            assert time.monotonic() < deadline
            peak_rss = max(peak_rss, rss_mib(proc.pid))
            time.sleep(0.1)
        peak_rss = max(peak_rss, rss_mib(proc.pid))  # slow readers still connected, not reading
        # the ordinary clients may finish before a single header timeout has passed (a fast machine): wait for
        # the state under test, a full round of slowloris connections cut by the server, not for a time
        deadline = time.monotonic() + 60
        while stats["closed_by_server"] < IDLE and time.monotonic() < deadline:
            peak_rss = max(peak_rss, rss_mib(proc.pid))
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(30)
        m = until_idle(lambda: metrics(url), 60, 0.1)
        end_rss = rss_mib(proc.pid)
        print(f"neighbours soak: {served} served; idle connections opened {stats['opened']}, closed by the server "
              f"{stats['closed_by_server']}; RSS warm {warm_rss:.1f}, peak {peak_rss:.1f}, end {end_rss:.1f} MiB")
        assert not problems, problems[:10]
        assert served == NEIGHBOUR_REQUESTS  # every ordinary client served, exactly
        assert stats["closed_by_server"] >= IDLE  # the header timeout really cut them (and they came back)
        assert m["octavo:kv_cache_usage_perc"] == 0 and m["octavo:num_requests_running"] == 0  # no leaked blocks
        assert max(peak_rss, end_rss) - warm_rss <= NEIGHBOUR_RSS_BOUND_MIB, (warm_rss, peak_rss, end_rss)
        assert httpx.get(url + "/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_soak_idle_connections_beside_normal_clients(folder, tmp_path) -> None:  # noqa: ANN001
    """Slowloris churn (IDLE connections that never finish a request, replaced as the server cuts them) while
    ordinary clients run: each of them served exactly, no leaked block, flat RSS."""
    neighbours_soak(folder, 0, tmp_path)


def test_soak_slow_readers_and_idle_connections_beside_normal_clients(folder, tmp_path) -> None:  # noqa: ANN001
    """The same beside SLOW_READERS streams whose clients never read: what they have not read is coalesced
    per request (AsyncEngine's OutputMailbox), so RSS stays within the same bound (+24 MiB before: a queue of
    cumulative outputs per request)."""
    neighbours_soak(folder, SLOW_READERS, tmp_path)
