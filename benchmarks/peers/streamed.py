"""Timed streaming requests against an HTTP peer (vLLM's /v1/completions): every request of a workload
sent at once, each streamed, with the client's clock read at the first and the last token. The same
timestamps as octavo's own RequestMetrics (first_token_time, last_token_time) and llama-server's own
timings, so single-request decode speed is measured alike for every engine:

    decode tok/s = (tokens - 1) / (t_last - t_first)     (the first token is the prefill's, left out)
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult
from octavo.bench.serve_client import sse_objects


@dataclass(slots=True)
class Streamed:
    """One streamed request: its token ids and the client's clock (perf_counter) at start, first and last token."""

    tokens: list[int] = field(default_factory=list)
    t_start: float = 0.0
    t_first: float | None = None
    t_last: float | None = None


def decode_stats(n_tokens: int, t_start: float, t_first: float | None, t_last: float | None) -> dict[str, float]:
    """TTFT and decode tok/s excluding the first token (empty when there is no second token to time)."""
    out: dict[str, float] = {}
    if t_first is not None:
        out["ttft_s"] = t_first - t_start
    if t_first is not None and t_last is not None and n_tokens > 1 and t_last > t_first:
        out["decode_tok_s"] = (n_tokens - 1) / (t_last - t_first)
    return out


async def stream_one(session: Any, url: str, payload: dict[str, Any],
                     tokens_of: Callable[[dict[str, Any]], list[int]]) -> Streamed:
    """POST PAYLOAD (stream: true) to URL; TOKENS_OF takes one SSE `data:` object to its new token ids."""
    res = Streamed(t_start=time.perf_counter())
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        async for obj in sse_objects(resp):
            if "error" in obj:
                raise RuntimeError(f"{url} streamed an error: {str(obj['error'])[:300]}")
            new = tokens_of(obj)
            if new:
                now = time.perf_counter()
                res.t_first = res.t_first if res.t_first is not None else now
                res.t_last = now
                res.tokens.extend(new)
    return res


def run_streamed(name: str, workload: IdWorkload, url: str, payload_of: Callable[[list[int], int], dict[str, Any]],
                 tokens_of: Callable[[dict[str, Any]], list[int]], *, warm_up: bool = True) -> PeerResult:
    """Send every request of WORKLOAD at once (after one small untimed warm-up request); elapsed time is
    the whole workload's wall clock. A one-request workload also gets TTFT and decode tok/s in extra."""
    import aiohttp

    async def go() -> tuple[list[Streamed], float]:
        conn = aiohttp.TCPConnector(limit=max(1, len(workload.requests)))
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
            if warm_up:  # shorter than a KV block: nothing of it can be reused by the timed prompts
                await stream_one(session, url, payload_of([5, 6, 7, 8], 4), tokens_of)
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(stream_one(session, url, payload_of(r.prompt, r.max_tokens), tokens_of)
                                          for r in workload.requests))
            return list(outs), time.perf_counter() - t0

    outs, elapsed = asyncio.run(go())
    res = PeerResult(name, workload.name, len(outs), workload.prompt_tokens, elapsed_s=elapsed)
    res.outputs = [o.tokens for o in outs]
    res.output_tokens = res.generated_tokens = sum(len(o) for o in res.outputs)
    if len(outs) == 1:
        o = outs[0]
        res.extra.update(decode_stats(len(o.tokens), o.t_start, o.t_first, o.t_last))
    return res
