"""Single-user decode speed with and without speculative decoding, on one model, in one run (ratios only).

    python -m benchmarks.bench_spec_decode [--model smollm2-135m-instruct] [--weights fp32] [--max-tokens 128]
        [--speculative-config JSON ...] [--json out.json]

Two workloads, each request alone (batch 1, greedy): "repeat" (rewrite / edit / quote a given text or code:
the answer repeats its prompt) and "chat" (unrepetitive answers). For each configuration: output tokens per
second of wall time and, with speculation, the acceptance rate; the ratio to no speculation, and that the
greedy tokens are the same (they must be). Default configurations: n-gram (4 tokens, lookup 2..4); add a
draft model with --speculative-config '{"model": "PATH", "num_speculative_tokens": 4}'.
"""
from __future__ import annotations

import argparse
import json
import time

from octavo import LLM, SamplingParams

TEXT = ("The engine keeps a paged KV cache: fixed-size blocks and a block table per sequence. Requests join and "
        "leave the batch every step, and long prompts are prefilled in chunks beside running decodes. A prefix "
        "cache lets requests that share a system prompt reuse its blocks instead of computing them again. ")
CODE = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)\n\n"
        "def median(xs):\n    ys = sorted(xs)\n    n = len(ys)\n    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2\n")
WORKLOADS = {
    "repeat": ["Repeat the following text exactly, word for word:\n\n" + TEXT * 2,
               "Fix the bug in this code and return the whole file:\n\n" + CODE,
               "Rewrite this paragraph with British spelling, changing nothing else:\n\n" + TEXT],
    "chat": ["Write a short poem about the sea.", "Give three tips for learning a new language.",
             "Explain what a hash table is to a child."],
}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def measure(model: str, spec: str | None, max_tokens: int, threads: int | None, weights: str | None) -> dict:
    llm = LLM(model, speculative_config=spec, num_threads=threads, weights=weights)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    out: dict = {}
    for name, prompts in WORKLOADS.items():
        before = llm.engine.stats()
        tokens, seconds, ids = 0, 0.0, []
        for p in prompts:
            t = time.perf_counter()
            o = llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0].outputs[0]
            seconds += time.perf_counter() - t
            tokens += len(o.token_ids)
            ids.append(list(o.token_ids))
        after = llm.engine.stats()
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        out[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, "ids": ids,
                     "acceptance_rate": accepted / drafted if drafted else None}
    llm.engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--weights", default=None, help="the target's weight format (e.g. fp32 for a GGUF's float export)")
    ap.add_argument("--speculative-config", action="append", default=None,
                    help="a configuration to compare (repeatable; default: n-gram)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = measure(args.model, None, args.max_tokens, args.num_threads, args.weights)
    rows = {}
    for spec in args.speculative_config or [NGRAM]:
        got = measure(args.model, spec, args.max_tokens, args.num_threads, args.weights)
        rows[spec] = {w: {"speedup": got[w]["tokens_per_second"] / base[w]["tokens_per_second"],
                          "acceptance_rate": got[w]["acceptance_rate"], "same_tokens": got[w]["ids"] == base[w]["ids"],
                          "tokens_per_second": got[w]["tokens_per_second"]} for w in WORKLOADS}
    for spec, r in rows.items():
        for w, v in r.items():
            rate = f"{100 * v['acceptance_rate']:.0f}%" if v["acceptance_rate"] is not None else "-"
            print(f"{w:7s} {v['speedup']:.2f}x  ({base[w]['tokens_per_second']:.1f} -> {v['tokens_per_second']:.1f} "
                  f"tok/s, acceptance {rate}, same tokens: {v['same_tokens']})  {spec}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": {w: {k: v for k, v in b.items() if k != "ids"} for w, b in base.items()},
                       "speculative": rows}, f, indent=2)


if __name__ == "__main__":
    main()
