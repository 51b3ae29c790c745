"""Embedding throughput: `octavo serve` on an embedding export of a GGUF (`octavo export GGUF OUT --pooling last`)
beside llama.cpp's `llama-server --embeddings --pooling last` on the same GGUF, one engine at a time, the same
threads, the same token-id inputs through each one's OpenAI `/v1/embeddings`.

Every request carries --per-request inputs, all requests are sent at once; the metric is input tokens per
second of wall clock (and inputs per second). The two engines' vectors are compared (cosine similarity per
input, both L2-normalized), so a fast wrong answer does not pass for a fast one.

    .venv/bin/python -m benchmarks.bench_embeddings --llama-server PATH [--model FILE.gguf] [--inputs 64] \\
        [--tokens 128] [--repeat 2] [--json FILE]

Default model: the embedded SmolLM2-135M-Instruct Q4_1 GGUF (a decoder with last-token pooling: what
matters here is the engine's speed on the same weights, not the vectors' quality).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.memory import ServerPeak
from benchmarks.peers.online import free_port, server_process
from benchmarks.peers.worker import thread_env


def inputs(vocab: int, n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(tokens)] for _ in range(n)]


async def _post_all(base: str, model: str, batches: list[list[list[int]]]) -> tuple[float, list[list[float]]]:
    import aiohttp

    async def one(session: aiohttp.ClientSession, batch: list[list[int]]) -> list[list[float]]:
        async with session.post(f"{base}/v1/embeddings", json={"model": model, "input": batch,
                                                                "encoding_format": "float"}) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{base} answered {resp.status}: {str(body)[:300]}")
            return [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]

    conn = aiohttp.TCPConnector(limit=len(batches))
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await one(session, [[(t * 7919 + 17) % 30000 + 100 for t in x] for x in batches[0]])  # warm-up: one
        # request of the timed ones' shape (other token ids), so first-run costs of that shape are not timed
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(session, b) for b in batches))
        return time.perf_counter() - t0, [v for o in outs for v in o]


def measure(name: str, cmd: list[str], base: str, model: str, data: list[list[int]], per_request: int,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    batches = [data[i:i + per_request] for i in range(0, len(data), per_request)]
    peak = ServerPeak()
    t0 = time.perf_counter()
    with server_process(cmd, base, env=env, peak=peak):
        load_s = time.perf_counter() - t0
        elapsed, vectors = asyncio.run(_post_all(base, model, batches))
    tokens = sum(len(x) for x in data)
    return {"engine": name, "elapsed_s": elapsed, "inputs_per_s": len(data) / elapsed, "tokens_per_s": tokens / elapsed,
            "load_s": load_s, "command": " ".join(cmd), **peak.extra(), "vectors": vectors}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = sum(x * x for x in a) ** 0.5, sum(y * y for y in b) ** 0.5
    return dot / (na * nb) if na and nb else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama-server binary")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--inputs", type=int, default=64, help="inputs in all (default 64)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per input (default 128)")
    p.add_argument("--per-request", type=int, default=8, help="inputs per /v1/embeddings request (default 8)")
    p.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the best per engine counts")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache/octavo/perf")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 1 <= args.inputs <= 4096 or not 1 <= args.tokens <= 8192 or not 1 <= args.per_request <= 2048:
        p.error("--inputs 1..4096, --tokens 1..8192, --per-request 1..2048")
    from octavo.export.embedded import default_model_path
    from octavo.export.gguf_reader import read_gguf

    gguf = args.model or default_model_path()
    vocab = int(read_gguf(gguf).config["vocab_size"])
    export = args.workdir / f"{gguf.stem}-{gguf.stat().st_size}-embed-last"
    if not (export / "octavo.json").is_file():
        subprocess.run([sys.executable, "-m", "octavo", "export", str(gguf), str(export), "--pooling", "last",
                        "--no-progress"], check=True)
    env = thread_env(args.threads)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load = Path("/proc/loadavg").read_text().split()[:3]
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.repeat):
        data = inputs(vocab, args.inputs, args.tokens, seed=rnd)
        port = free_port()
        cmd = [sys.executable, "-m", "octavo", "serve", str(export), "--port", str(port), "--num-threads",
               str(args.threads), "--served-model-name", "emb"]
        mine = measure("octavo serve", cmd, f"http://127.0.0.1:{port}", "emb", data, args.per_request, env)
        row = {"round": rnd, "octavo": mine}
        if args.llama_server:
            port = free_port()
            slots = args.per_request
            cmd = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--embeddings",
                   "--pooling", "last", "-t", str(args.threads), "-tb", str(args.threads), "-ngl", "0",
                   "-np", str(slots), "-c", str(slots * (args.tokens + 16)), "-b", str(max(2048, args.tokens)),
                   "-ub", str(max(512, args.tokens))]
            theirs = measure("llama-server --embeddings", cmd, f"http://127.0.0.1:{port}", "emb", data,
                             args.per_request)
            sims = [cosine(a, b) for a, b in zip(mine["vectors"], theirs["vectors"])]
            row["llama"] = theirs
            row["min_cosine"] = min(sims)
            row["octavo_over_llama"] = mine["tokens_per_s"] / theirs["tokens_per_s"]
        for e in ("octavo", "llama"):
            if e in row:
                row[e].pop("vectors")
        rounds.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "command"})
                          for k, v in row.items()}), flush=True)
    best = {e: max((r[e] for r in rounds if e in r), key=lambda x: x["tokens_per_s"], default=None)
            for e in ("octavo", "llama")}
    report = {"date": started, "loadavg_before": load, "threads": args.threads, "model": str(gguf),
              "inputs": args.inputs, "tokens": args.tokens, "per_request": args.per_request, "rounds": rounds,
              "best": best}
    if best["llama"]:
        report["octavo_over_llama_best"] = best["octavo"]["tokens_per_s"] / best["llama"]["tokens_per_s"]
        per_round = ", ".join(f"{r['octavo_over_llama']:.2f}x" for r in rounds)
        print(f"octavo {best['octavo']['tokens_per_s']:.0f} tok/s, llama-server {best['llama']['tokens_per_s']:.0f} "
              f"tok/s: {report['octavo_over_llama_best']:.2f}x; per round {per_round}; min cosine "
              f"{min(r['min_cosine'] for r in rounds):.4f}")
    out = args.json or args.workdir / f"embed-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
