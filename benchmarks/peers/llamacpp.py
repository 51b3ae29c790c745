"""llama.cpp peer: `llama-server` with -np slots (continuous batching), the GGUF F32 written by octavo's
own writer. Only runs when a binary path is given (LLAMA_SERVER or --llama-server); nothing here builds
or downloads llama.cpp.

Offline: every request is sent at once to /completion (token-id prompt, n_predict, temperature 0 =
greedy, ignore_eos) and the wall clock of the whole workload is the elapsed time. A one-request workload
also reports llama-server's own timings of it: decode tok/s is its `predicted_per_second`, which is
(tokens - 1) / (last token - first token), the first token left out like everywhere in the comparison,
and TTFT its `prompt_ms`. (Not a client clock on a stream: llama-server sends no event for a token that
ends in an incomplete UTF-8 sequence, so streamed token ids would be missing some.) Online: the same
Poisson client as for `octavo serve`, against llama-server's /v1/completions.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.memory import ServerPeak
from benchmarks.peers.online import free_port, poisson_run, server_process
from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult

NAME = "llama.cpp llama-server"


def server_command(binary: str, gguf: Path, port: int, *, slots: int, ctx_per_slot: int, threads: int,
                   extra: list[str] | None = None) -> list[str]:
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "-ngl", "0", *(extra or [])]


def ctx_per_slot(workload: IdWorkload) -> int:
    need = max(len(r.prompt) + r.max_tokens for r in workload.requests) + 8
    return -(-need // 256) * 256


async def _offline(base: str, workload: IdWorkload) -> tuple[list[list[int]], float, list[dict[str, Any]]]:
    """(token ids per request, wall clock of the workload, llama-server's timings per request)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, prompt: list[int], n: int) -> tuple[list[int], dict[str, Any]]:
        payload: dict[str, Any] = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                                   "return_tokens": True, "stream": False}
        async with session.post(f"{base}/completion", json=payload) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"llama-server answered {resp.status}: {str(body)[:300]}")
            tokens = body.get("tokens")
            return (list(tokens) if tokens else [-1] * int(body.get("tokens_predicted", 0))), body.get("timings") or {}

    conn = aiohttp.TCPConnector(limit=len(workload.requests))
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
        await one(session, [5, 6, 7, 8], 4)  # warm-up
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(session, r.prompt, r.max_tokens) for r in workload.requests))
        elapsed = time.perf_counter() - t0
        return [o for o, _ in outs], elapsed, [t for _, t in outs]


def run_offline(binary: str, gguf: Path, workload: IdWorkload, *, threads: int, slots: int,
                extra_args: list[str] | None = None, name: str = NAME) -> PeerResult:
    port = free_port()
    slots = min(slots, len(workload.requests))
    cmd = server_command(binary, gguf, port, slots=slots, ctx_per_slot=ctx_per_slot(workload), threads=threads,
                         extra=extra_args)
    base = f"http://127.0.0.1:{port}"
    peak = ServerPeak()  # llama-server's own peak RSS, read before it is stopped
    t0 = time.perf_counter()
    with server_process(cmd, base, peak=peak):
        load_s = time.perf_counter() - t0  # process start to /health answering 200
        outputs, elapsed, timings = asyncio.run(_offline(base, workload))
    res = PeerResult(name, workload.name, len(outputs), workload.prompt_tokens, elapsed_s=elapsed)
    res.outputs = [o if all(t >= 0 for t in o) else [] for o in outputs]
    res.output_tokens = res.generated_tokens = sum(len(o) for o in outputs)
    if not all(res.outputs):
        res.outputs = []  # this llama-server does not return token ids: no agreement check
    res.extra = {"slots": slots, "command": " ".join(cmd), "load_s": load_s, **peak.extra()}
    if len(timings) == 1:
        own = timings[0]
        if own.get("predicted_n", 0) > 1 and own.get("predicted_per_second"):
            res.extra["decode_tok_s"] = float(own["predicted_per_second"])
        if own.get("prompt_ms") is not None:
            res.extra["ttft_s"] = float(own["prompt_ms"]) / 1000.0
        res.extra["timings"] = own
    return res


def run_online(binary: str, gguf: Path, workload: IdWorkload, *, threads: int, slots: int, rate: float,
               seed: int = 0, extra_args: list[str] | None = None) -> PeerResult:
    port = free_port()
    cmd = server_command(binary, gguf, port, slots=min(slots, len(workload.requests)),
                         ctx_per_slot=ctx_per_slot(workload), threads=threads, extra=extra_args)
    base = f"http://127.0.0.1:{port}"
    peak = ServerPeak()
    with server_process(cmd, base, peak=peak):
        res = poisson_run(NAME, base, workload, rate, seed)
    res.extra.update(peak.extra())
    return res
