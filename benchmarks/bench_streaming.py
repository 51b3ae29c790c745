"""Streaming cost by output length: the server-side CPU time per streamed token, from 16 to 4,096 tokens.

Serves MODEL in-process (OpenAIServer on a ServerThread, the app `octavo serve` runs) and streams greedy
requests of max(--lengths) tokens per choice (n choices, logprobs, ignore_eos) with httpx. While one
stream runs, the client notes the process's CPU time, the backend's (a wrapper sums Backend.run), its own
thread's (it parses every chunk) and the tokens and chunks received when every choice has received
L - --window and L tokens, for each L of --lengths. The CPU time of that window, minus what the backend
computed and minus the client's, is the server-side cost per token AT output length L: the engine's thread
outside Backend.run plus the server's event loop.

What makes the windows comparable:
- every window has the same size, so the best of --rounds is equally lucky at every length, and it lies
  inside one stream: a request's fixed cost (prefill, headers, the first chunks) and the machine's load
  drifting between separate requests stay out of it;
- CPU time, not wall time: waiting for a core on a shared machine would swamp it;
- the same number of chunks per token at every length. A client that falls behind gets several tokens per
  chunk (the engine coalesces what it has not read, docs/engine.md), and a chunk costs the server more than
  a token: with a fast step (short context) the in-process client falls behind and the per-token cost
  looks lower than with a slow one (long context) — an artifact of the client's pace, not the server's
  work. So every step lasts at least --pace-ms (the backend sleeps the rest; sleeping costs no CPU),
  enough for the client to read every chunk: the tokens-per-chunk column shows 1.00 where it did.

Backends (--backends, each with its own server, one after the other): "constant" answers every step from a
fixed pool of random logits rows, the same work at every length, so all that grows is the engine's and the
server's own work; "model" is the real model (attention over a longer context every step).

    python -m benchmarks.bench_streaming MODEL [--lengths 32,64,256,1024,4096] [--window 16] [--pace-ms 6]

Only public APIs (EngineArgs, AsyncEngine, OpenAIServer, ServerThread, the Backend protocol), so the same
script measures an older checkout side by side (PYTHONPATH=that checkout).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import numpy as np

from octavo.export.manifest import Manifest
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.state import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer

BACKENDS = ("constant", "model")
Mark = tuple[float, float, float, int, int]  # process CPU s, backend CPU s, client CPU s, tokens, chunks


class TimedBackend:
    """Delegates to a backend and sums the CPU seconds its run() takes (one intra-op thread: the caller's);
    KIND "constant" answers from a fixed pool of random logits rows instead. Every run lasts at least PACE
    seconds of wall time (it sleeps the rest)."""

    def __init__(self, inner: OnnxRuntimeBackend, kind: str, pace: float) -> None:
        self.inner, self.kind, self.pace = inner, kind, pace
        self.num_blocks, self.block_size, self.vocab_size = inner.num_blocks, inner.block_size, inner.vocab_size
        self.seconds = 0.0
        self._pool = np.random.default_rng(0).standard_normal((64, inner.vocab_size)).astype(np.float32) * 3
        self._steps = 0

    def run(self, inputs):  # noqa: ANN001, ANN201
        start, t0 = time.monotonic(), time.thread_time()
        if self.kind == "model":
            logits = self.inner.run(inputs)
        else:
            self._steps += 1
            logits = self._pool[(self._steps * 7 + np.arange(len(inputs.logits_indices))) % len(self._pool)]
        self.seconds += time.thread_time() - t0
        time.sleep(max(0.0, self.pace - (time.monotonic() - start)))
        return logits

    def close(self) -> None:
        self.inner.close()


def stream_marks(base_url: str, backend: TimedBackend, lengths: list[int], n: int,
                 logprobs: int | None) -> dict[int, Mark]:
    """One streamed completion of max(LENGTHS) tokens for each of N choices: for each length, a Mark taken
    once every choice had received that many tokens (a chunk may carry several: the counts say how many)."""
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": max(lengths), "n": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            **({"logprobs": logprobs} if logprobs is not None else {})}
    received, chunks, todo = [0] * n, 0, sorted(lengths)
    marks = {0: (time.process_time(), backend.seconds, time.thread_time(), 0, 0)}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:  # what a client does with each chunk
                received[c["index"]] += len(c.get("token_ids") or ())
                chunks += 1
            while todo and min(received) >= todo[0]:
                marks[todo.pop(0)] = (time.process_time(), backend.seconds, time.thread_time(), sum(received), chunks)
    assert not todo, f"the stream ended before every choice had {todo[0]} tokens: {received}"
    return marks


def measure(args: argparse.Namespace, kind: str, lengths: list[int]) -> dict[int, tuple[float, ...]]:
    """Per length L, window (L - --window, L]: the best over --rounds of (server side µs per token, client µs
    per token, backend µs per token, tokens per chunk)."""
    ea = EngineArgs(model=str(Path(args.model)), num_blocks=args.n * ((max(lengths) + 64) // 16 + 1) + 8,
                    block_size=16, max_num_seqs=args.n, num_threads=args.num_threads)
    holder: dict[str, TimedBackend] = {}

    def load() -> AsyncEngine:
        eng_dir = Path(args.model)
        inner = OnnxRuntimeBackend(eng_dir, Manifest.load(eng_dir), ea.num_blocks, ea.block_size,
                                   num_threads=ea.num_threads)
        holder["b"] = TimedBackend(inner, kind, args.pace_ms / 1e3)
        return AsyncEngine(ea, holder["b"])

    best: dict[int, tuple[float, ...]] = {}
    srv = OpenAIServer(ServerConfig(served_model_names=("m",)), load, shutdown_timeout=5)
    with ServerThread(srv) as s:
        stream_marks(s.base_url, holder["b"], [16], args.n, args.logprobs)  # warm-up
        for _ in range(args.rounds):
            marks = stream_marks(s.base_url, holder["b"], sorted({*lengths, *(x - args.window for x in lengths)}),
                                 args.n, args.logprobs)
            for cur in lengths:
                (p0, b0, c0, t0, k0), (p1, b1, c1, t1, k1) = marks[cur - args.window], marks[cur]
                us = [x / (t1 - t0) * 1e6 for x in (p1 - p0 - (b1 - b0) - (c1 - c0), c1 - c0, b1 - b0)]
                got = (*us, (t1 - t0) / max(1, k1 - k0))
                best[cur] = min(best.get(cur, got), got)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", default="32,64,256,1024,4096", help="output lengths at which windows end")
    ap.add_argument("--window", type=int, default=16, help="tokens per choice in each window")
    ap.add_argument("--pace-ms", type=float, default=6.0, help="each step lasts at least this long (wall)")
    ap.add_argument("--n", type=int, default=4, help="choices per request (each streams its own chunks)")
    ap.add_argument("--logprobs", type=int, default=5, help="top logprobs per token (-1: none)")
    ap.add_argument("--rounds", type=int, default=5, help="best of this many streams per window")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    kinds = args.backends.split(",")
    if args.logprobs < 0:
        args.logprobs = None
    if not 0 < args.window <= min(lengths):
        ap.error("--window must be positive and at most the smallest length")
    results = {kind: measure(args, kind, lengths) for kind in kinds}
    print(f"n={args.n} choices, logprobs={args.logprobs}, windows of {args.window} tokens per choice, steps of "
          f"at least {args.pace_ms:g} ms, best of {args.rounds} streams per window; µs of CPU per streamed token")
    print("| tokens per choice (window) | "
          + " | ".join(f"{k}: server side | {k}: client | {k}: tokens / chunk" for k in kinds)
          + (" | model: backend |" if "model" in kinds else " |"))
    print("| ---: " * (3 * len(kinds) + 1 + ("model" in kinds)) + "|")
    for cur in lengths:
        cells = [f"{results[k][cur][0]:.0f} | {results[k][cur][1]:.0f} | {results[k][cur][3]:.2f}" for k in kinds]
        cells += [f"{results['model'][cur][2]:.0f}"] if "model" in kinds else []
        print(f"| {cur - args.window + 1}-{cur} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
