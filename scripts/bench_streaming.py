"""Streaming cost by output length: the server-side time per streamed token, from 16 to 4,096 tokens.

Serves MODEL in-process (OpenAIServer on a ServerThread, the app `octavo serve` runs), streams one greedy
request of N tokens per choice (n choices, logprobs, ignore_eos) per length with httpx, and subtracts the
CPU time the backend computed (a wrapper sums Backend.run) from the process's CPU time: what remains is
the engine + server overhead (the client's SSE parsing, constant per token, included). CPU time, not wall
time: on a shared, loaded machine the wait for a core would swamp it. The marginal column (the tokens
between two lengths) is the per-token cost at that length without the request's fixed cost; flat in N
means a step's output work does not grow with the output.

    PYTHONPATH=. python scripts/bench_streaming.py MODEL [--lengths 16,64,256,1024,4096] [--n 4] [--logprobs 5]

Only public APIs (EngineArgs, AsyncEngine, OpenAIServer, ServerThread), so the same script measures an
older checkout side by side (PYTHONPATH=that checkout).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.app import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer


class TimedBackend:
    """Delegates to a backend and sums the CPU seconds its run() takes (one intra-op thread: the caller's)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.num_blocks, self.block_size, self.vocab_size = inner.num_blocks, inner.block_size, inner.vocab_size
        self.seconds = 0.0

    def run(self, inputs):  # noqa: ANN001, ANN201
        t0 = time.thread_time()
        try:
            return self.inner.run(inputs)
        finally:
            self.seconds += time.thread_time() - t0

    def close(self) -> None:
        self.inner.close()


def stream_once(base_url: str, backend: TimedBackend, n_tokens: int, n: int, logprobs: int | None) -> tuple[float, float]:
    """One streamed completion of N_TOKENS tokens for each of N choices: (CPU seconds of this process from
    sending to [DONE], CPU seconds the backend computed meanwhile). CPU time, not wall time: on a shared,
    loaded machine waiting for a core would swamp what is measured."""
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": n_tokens, "n": n, "temperature": 0,
            "ignore_eos": True, "stream": True, **({"logprobs": logprobs} if logprobs is not None else {})}
    t0, b0 = time.process_time(), backend.seconds
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])  # what a client does with each chunk
    return time.process_time() - t0, backend.seconds - b0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", default="16,64,256,1024,4096")
    ap.add_argument("--n", type=int, default=4, help="choices per request (each streams its own chunks)")
    ap.add_argument("--logprobs", type=int, default=5, help="top logprobs per token (-1: none)")
    ap.add_argument("--rounds", type=int, default=3, help="best of this many streams per length")
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.logprobs < 0:
        args.logprobs = None
    ea = EngineArgs(model=str(Path(args.model)), num_blocks=args.n * ((max(lengths) + 64) // 16 + 1) + 8, block_size=16,
                    max_num_seqs=4, num_threads=args.num_threads)
    holder: dict[str, TimedBackend] = {}

    def load() -> AsyncEngine:
        from octavo.export.manifest import Manifest
        from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

        eng_dir = Path(args.model)
        inner = OnnxRuntimeBackend(eng_dir, Manifest.load(eng_dir), ea.num_blocks, ea.block_size, num_threads=ea.num_threads)
        holder["b"] = TimedBackend(inner)
        return AsyncEngine(ea, holder["b"])

    srv = OpenAIServer(ServerConfig(served_model_names=("m",)), load, shutdown_timeout=5)
    with ServerThread(srv) as s:
        def overhead(n_tokens: int) -> float:  # best of --rounds: seconds not spent in the backend
            return min(w - b for w, b in (stream_once(s.base_url, holder["b"], n_tokens, args.n, args.logprobs)
                                          for _ in range(args.rounds)))

        overhead(16)  # warm-up
        print(f"n={args.n} choices, logprobs={args.logprobs}, best of {args.rounds}")
        print("| tokens per choice | CPU µs per streamed token, excluding the backend | marginal µs per token "
              "(vs the previous length) |")
        print("| ---: | ---: | ---: |")
        prev: tuple[int, float] | None = None
        for n_tokens in lengths:
            o = overhead(n_tokens)
            marginal = f"{(o - prev[1]) / ((n_tokens - prev[0]) * args.n) * 1e6:.0f}" if prev else "-"
            print(f"| {n_tokens} | {o / (n_tokens * args.n) * 1e6:.0f} | {marginal} |", flush=True)
            prev = (n_tokens, o)


if __name__ == "__main__":
    main()
