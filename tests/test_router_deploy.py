"""Several `octavo serve` replicas behind a real LLM router from PyPI (`vllm-router`, vLLM's production router: a Rust
binary in its wheel), as docs/deploy.md sets it up: two replicas of the embedded model on loopback ports, one router
with the cache-aware policy and one with round-robin over the same replicas. A shared-prefix multi-tenant workload
(several long system prompts, many users each) goes through each router with the real `openai` client (streaming, no
client retries); the replicas' own /metrics (vLLM's names) say the prefix-cache hits and how many requests each
finished. Cache-aware routing keeps each tenant on one replica, so the summed hit rate and the p50 time to first
token beat round-robin, which makes every replica hold every tenant's prefix (more than its cache holds). Then a
replica is killed (SIGKILL) mid-run: only its in-flight requests are lost, and the client sees them as errors
(vllm-router does not replay a request whose worker died after accepting it); requests sent afterwards are all
answered by the survivor.

Needs `pip install 'octavo[router]'` (skipped without the `vllm-router` command: not in `make test`'s extras).
~4.5 min on 2 loaded cores (`pytest -m slow tests/test_router_deploy.py -s` prints the ratios)."""
from __future__ import annotations

import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import start_serve, stop

_BIN = Path(sys.executable).with_name("vllm-router")
ROUTER = str(_BIN) if _BIN.exists() else shutil.which("vllm-router")
if ROUTER is None:
    pytest.skip("vllm-router is not installed (pip install 'octavo[router]')", allow_module_level=True)

MODEL = "smollm2-135m-instruct"  # the embedded model's served name
TENANTS, USERS = 7, 6  # 42 requests a run; an odd count, so round-robin's alternation is not by accident
# a fixed tenant-to-replica split
# each replica's KV cache: 100 blocks of 16 tokens. A tenant's system prompt is ~17 blocks, so one replica holds
# about 5 tenants' prefixes: cache-aware (3-4 tenants a replica) fits, round-robin (all 7, cycled) evicts each one
# just before it is needed again (the LRU's worst case, as in any cache smaller than its working set).
REPLICA_ARGS = ["--port", "0", "--num-threads", "1", "--num-blocks", "100", "--max-model-len", "1024"]
WORDS = ("ledger invoice shipment warranty refund account billing route carrier parcel customs tariff schedule "
         "battery firmware sensor gateway pump valve reactor turbine audit policy premium claim broker").split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(run: str, tenant: int) -> str:
    """A tenant's own ~270-token instructions; RUN keeps each run's prefixes apart from the previous run's."""
    rng = random.Random(f"{run}-{tenant}")
    rules = " ".join(f"Rule {i}: always mention the {rng.choice(WORDS)} and the {rng.choice(WORDS)}."
                     for i in range(22))
    return f"Tenant {run}-{tenant} support assistant. {rules}"


def metrics(url: str) -> dict[str, float]:
    """The replica's counters and gauges this test reads, summed over labels (successes: errors left out)."""
    out = {"hits": 0.0, "queries": 0.0, "success": 0.0, "running": 0.0, "waiting": 0.0}
    names = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries",
             "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] += s.value
            elif s.name == "vllm:request_success_total" and s.labels.get("finished_reason") != "error":
                out["success"] += s.value
    return out


@dataclass(slots=True)
class Answer:
    key: str
    ttft: float | None  # seconds to the first content chunk; None: the request failed
    text: str
    error: str | None = None


def ask(base: str, key: str, system: str, user: str, max_tokens: int, ignore_eos: bool = False) -> Answer:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    start = time.perf_counter()
    ttft, parts, finish = None, [], None
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": ignore_eos})
        for chunk in stream:
            for c in chunk.choices:
                if c.delta.content:
                    ttft = time.perf_counter() - start if ttft is None else ttft
                    parts.append(c.delta.content)
                finish = c.finish_reason or finish
    except (openai.APIError, httpx.HTTPError) as e:
        return Answer(key, None, "".join(parts), f"{type(e).__name__}: {e}")
    if finish is None:
        return Answer(key, None, "".join(parts), "stream ended without a finish_reason")
    return Answer(key, ttft, "".join(parts))


def workload(run: str) -> list[tuple[str, str, str]]:
    """(key, system, user): users arrive interleaved across tenants, as many tenants' traffic does."""
    return [(f"{run}/t{t}/u{u}", system_prompt(run, t), f"User {u} of tenant {t}: where is my order {1000 + u}?")
            for u in range(USERS) for t in range(TENANTS)]


@dataclass(slots=True)
class Run:
    hit_rate: float
    p50_ttft: float
    answers: list[Answer]
    success: float  # requests the replicas finished during the run (their /metrics)


def run_through(router: str, replicas: list[str], run: str) -> Run:
    before = [metrics(r) for r in replicas]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda w: ask(router, w[0], w[1], w[2], 8), workload(run)))
    after = [metrics(r) for r in replicas]
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    ttfts = [a.ttft for a in answers if a.ttft is not None]
    return Run(hits / queries, statistics.median(ttfts) if ttfts else float("inf"), answers,
               sum(a["success"] - b["success"] for a, b in zip(after, before)))


class Router:
    """`vllm-router --policy POLICY` over WORKERS on a free loopback port, ready once it routes /v1/models."""

    def __init__(self, policy: str, workers: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._log = log
        self.proc = subprocess.Popen(
            [ROUTER, "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--policy", policy,
             "--worker-urls", *workers, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
             "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
             "--health-failure-threshold", "1", "--log-level", "warning"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[subprocess.Popen, str]]]:
    started: list[tuple[subprocess.Popen, str]] = []
    try:
        for _ in range(2):
            started.append(start_serve(REPLICA_ARGS, ready_s=300))
        for _, url in started:  # first inference (ORT's warm-up) out of the measurements
            assert ask(url, "warm", "warm-up", "hi", 2).error is None
        yield started
    finally:
        for proc, _ in started:
            stop(proc)


@pytest.mark.slow
def test_cache_aware_beats_round_robin(replicas, tmp_path) -> None:  # noqa: ANN001
    urls = [u for _, u in replicas]
    results: dict[str, Run] = {}
    for policy in ("round_robin", "cache_aware"):
        router = Router(policy, urls, tmp_path / f"{policy}.log")
        try:
            results[policy] = run_through(router.url, urls, policy)
        finally:
            router.close()
    for policy, r in results.items():
        n = TENANTS * USERS
        assert [a.error for a in r.answers] == [None] * n, policy
        assert len({a.key for a in r.answers}) == n and all(a.text for a in r.answers), policy
        assert r.success == n, f"{policy}: the replicas finished {r.success} requests for {n} sent (exactly once)"
    ca, rr = results["cache_aware"], results["round_robin"]
    print(f"\nprefix-cache hit rate: cache_aware {ca.hit_rate:.3f}, round_robin {rr.hit_rate:.3f}"
          f" (ratio {ca.hit_rate / max(rr.hit_rate, 1e-9):.2f}); p50 TTFT: cache_aware {ca.p50_ttft * 1e3:.0f} ms,"
          f" round_robin {rr.p50_ttft * 1e3:.0f} ms (ratio {rr.p50_ttft / ca.p50_ttft:.2f}x faster)")
    assert ca.hit_rate > rr.hit_rate + 0.2, (ca.hit_rate, rr.hit_rate)
    assert ca.p50_ttft < rr.p50_ttft, (ca.p50_ttft, rr.p50_ttft)


def _admitted(urls: list[str], base: list[dict[str, float]]) -> float:
    m = [metrics(u) for u in urls]
    return sum(x["running"] + x["waiting"] + x["success"] - b["success"] for x, b in zip(m, base))


@pytest.mark.slow
def test_replica_killed_mid_run(replicas, tmp_path) -> None:  # noqa: ANN001
    """Runs after the comparison (it kills the second replica)."""
    (proc_a, a), (proc_b, b) = replicas
    router = Router("cache_aware", [a, b], tmp_path / "kill.log")
    try:
        base = [metrics(a), metrics(b)]
        wave = [(f"kill/t{t}", system_prompt("kill", t), "Tell me a long story.") for t in range(6)]
        pool = ThreadPoolExecutor(6)
        first = [pool.submit(ask, router.url, k, s, u, 96, True) for k, s, u in wave]
        deadline = time.monotonic() + 120
        while _admitted([a, b], base) < len(wave) or metrics(b)["running"] == 0:  # every request at a replica, b busy
            assert time.monotonic() < deadline, "the wave never reached replica b"
            time.sleep(0.05)
        on_b = metrics(b)
        in_flight_b = on_b["running"] + on_b["waiting"]
        proc_b.send_signal(signal.SIGKILL)
        proc_b.wait()
        answers = [f.result() for f in first]
        second = [ask(router.url, f"after/t{t}", system_prompt("kill", t), "Hello again.", 4) for t in range(6)]
        pool.shutdown()
        lost = [x for x in answers if x.error]
        print(f"\nkilled a replica with {in_flight_b:.0f} requests in flight: {len(lost)} of {len(wave)} client"
              f" requests failed ({[x.error[:80] for x in lost][:2]}),"
              f" {sum(x.error is None for x in second)}/{len(second)} later requests answered")
        assert 1 <= len(lost) <= in_flight_b, (len(lost), in_flight_b)
        assert all(x.error is None and x.text for x in second), [x.error for x in second]
        # exactly once: every answer the client got was finished by one replica, once
        client_ok = sum(x.error is None for x in answers + second)
        done_a = metrics(a)["success"] - base[0]["success"]
        done_b = on_b["success"] - base[1]["success"]  # b's count just before the kill
        assert done_b <= client_ok - done_a <= done_b + in_flight_b - len(lost), (client_ok, done_a, done_b)
    finally:
        router.close()
