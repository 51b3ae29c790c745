"""`octavo bench throughput MODEL` (offline, octavo.LLM) and `octavo bench serve --base-url URL` (online, HTTP)."""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

HELP = "benchmark offline throughput (through octavo.LLM) or a running server (like `vllm bench serve`)"


def _workload_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="random",
                   help="random | seed10 | shared-prefix | PATH.jsonl ({'prompt', 'max_tokens'} per line; "
                        "default: %(default)s)")
    g.add_argument("--num-prompts", type=int, default=None, help="requests (default: 100 random, 10 seed10, 32 shared-prefix)")
    g.add_argument("--input-len", type=int, default=128, help="random: mean prompt length (tokens)")
    g.add_argument("--output-len", type=int, default=32, help="random / shared-prefix: tokens to generate")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1±ratio)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: words in the shared system prompt")
    if seed:  # bench throughput: the engine's --seed seeds the workload too
        g.add_argument("--seed", type=int, default=0, help="seed of the random workload and of sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--save-result", metavar="FILE", default=None, help="write the result as JSON (default: not saved)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from octavo.commands.engine_flags import add_engine_arguments

    sub = p.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    t = sub.add_parser("throughput", help="offline: every request at once through octavo.LLM",
                       formatter_class=p.formatter_class)
    t.add_argument("model", help="export folder, HF checkpoint folder, .gguf file or 'smollm2-135m-instruct'")
    _workload_args(t, seed=False)
    t.add_argument("--profile", action="store_true",
                   help="time each step's phases (schedule, pack, backend, sample, detokenize, other) and print them")
    add_engine_arguments(t)
    s = sub.add_parser("serve", help="online: replay a workload against a running server's /v1/completions",
                       formatter_class=p.formatter_class)
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    s.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    s.add_argument("--api-key", default=None, help="bearer token (default: none)")
    s.add_argument("--tokenizer", default=None,
                   help="export folder or tokenizer.json: exact-length token-id prompts for --workload random "
                        "(default: none, text prompts)")
    s.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (inf = burst)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    _workload_args(s)


def _vocab(path: str | None):  # noqa: ANN202
    from octavo.bench.workloads import Vocab

    if path is None:
        return None
    p = Path(path)
    return Vocab.from_tokenizer_file(p / "tokenizer.json" if p.is_dir() else p)


def _workload(args: argparse.Namespace, vocab) -> list:  # noqa: ANN001
    from octavo.bench.workloads import load_workload

    return load_workload(args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
                         seed=args.seed, vocab=vocab)


def run(args: argparse.Namespace) -> int:
    return _throughput(args) if args.bench_mode == "throughput" else _serve(args)


def _throughput(args: argparse.Namespace) -> int:
    from octavo.bench.report import save_json
    from octavo.bench.throughput import run_throughput
    from octavo.bench.workloads import Vocab
    from octavo.commands.engine_flags import engine_args
    from octavo.export.embedded import model_argument
    from octavo.runtime.llm import LLM

    llm = LLM.from_engine_args(engine_args(args, model_argument(args.model)[0]))
    try:
        tok = llm.get_tokenizer()
        vocab = Vocab(llm.engine.vocab_size, frozenset(t for t in (tok.bos_token_id, *tok.eos_token_ids) if t is not None))
        requests = _workload(args, vocab)
        profile = None
        if args.profile:
            from octavo.bench.profile import attach_profiler

            profile = attach_profiler(llm.engine)
        result = run_throughput(llm, requests, temperature=args.temperature, seed=args.seed)
    finally:
        llm.close()
    print(result.table())
    if profile is not None:
        print("where a step's time goes (overhead = share of the step outside the backend):")
        print(profile.table())
    if args.save_result:
        data = {"date": time.strftime("%Y%m%d-%H%M%S"), "model": args.model, "workload": args.workload,
                **result.to_dict()}
        if profile is not None:
            data["profile"] = profile.to_dict()
        print(f"saved {save_json(args.save_result, data)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from octavo.bench.report import save_json, serve_table, summarize
    from octavo.bench.serve_client import ServeBenchConfig, run_serve_bench

    requests = _workload(args, _vocab(args.tokenizer))
    cfg = ServeBenchConfig(base_url=args.base_url.rstrip("/"), model=args.model, api_key=args.api_key,
                           request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                           temperature=args.temperature)
    results, duration, model = asyncio.run(run_serve_bench(cfg, requests))
    summary = summarize(results, duration)
    summary.update({"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "octavo", "model_id": model,
                    "base_url": cfg.base_url, "workload": args.workload, "num_prompts": len(requests),
                    "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                    "max_concurrency": args.max_concurrency})
    print(serve_table(summary))
    failed = [e for e in summary["errors"] if e]
    if failed:
        print(f"{len(failed)} requests failed; first error: {failed[0]}")
    if args.save_result:
        print(f"saved {save_json(args.save_result, summary)}")
    return 0 if not failed else 1
