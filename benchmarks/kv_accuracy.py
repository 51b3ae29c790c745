"""How much a KV cache element type changes a model's outputs, against a reference pool type, in one run.

    python -m benchmarks.kv_accuracy [--model smollm2-135m-instruct] [--candidates int8,float32]
        [--reference float16] [--max-tokens 128] [--json out.json]

Two measurements per candidate pool type (each engine alone, greedy, 2 threads unless --threads):
- teacher-forced: a ~1,500-token English text (README-like prose and code) scored with prompt_logprobs=1 in
  chunks of --chunk tokens (so later chunks read their history from the pool): how often the top-1 token at a
  position differs from the reference's, and the largest / mean change of the actual next token's logprob;
- free-running: greedy answers to chat prompts: how many are token-for-token the reference's, and where the
  first difference comes when they are not.
Prints a table and writes JSON where --json says (nothing is written otherwise).
"""
from __future__ import annotations

import argparse
import json
import logging

import numpy as np

from octavo import LLM, SamplingParams

PROSE = (
    "A paged KV cache stores the keys and values of every token a sequence has seen in fixed-size blocks, and "
    "a block table maps the sequence's logical positions to physical blocks, so memory is allocated as the "
    "sequence grows instead of being reserved for the longest possible context. Continuous batching lets "
    "requests join and leave the running batch at every step: a long prompt is prefilled in chunks next to the "
    "decode steps of other requests, and a request that finishes frees its blocks at once. When two requests "
    "share a system prompt, the prefix cache hands the second one the blocks the first one computed. "
)
CODE = (
    "def merge(left, right):\n    out = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            out.append(left[i]); i += 1\n        else:\n"
    "            out.append(right[j]); j += 1\n    return out + left[i:] + right[j:]\n\n"
    "def sort(xs):\n    if len(xs) <= 1:\n        return xs\n    mid = len(xs) // 2\n"
    "    return merge(sort(xs[:mid]), sort(xs[mid:]))\n\n"
)
HISTORY = (
    "The printing press spread across Europe within a few decades of its invention. Printers in Venice, Paris "
    "and Antwerp competed on type faces, paper and price, and the small octavo format made books cheap enough "
    "to carry. Scholars corresponded about errors in editions, and readers began to expect that two copies of "
    "a book would say the same thing on the same page. "
)
TEXT = (PROSE + CODE + HISTORY) * 3
PROMPTS = [
    "Explain how a hash table handles collisions.", "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?", "Give me a recipe for a simple tomato soup.",
    "Summarize the plot of Romeo and Juliet in a paragraph.", "How does a bicycle stay upright?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between weather and climate?",
]


def teacher_forced(llm: LLM, ids: list[int], chunk: int) -> list[tuple[int, float]]:
    """(top-1 token, logprob of the actual next token) at every position after the first."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    rows = []
    for pos, entry in enumerate(out.prompt_logprobs or []):
        if pos == 0 or entry is None:
            continue
        actual = entry[ids[pos]].logprob
        top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
        rows.append((top, actual))
    return rows


def forced_runs(model: str, variants: dict[str, dict], positions: int = 600, chunk: int = 128,
                threads: int | None = 2) -> dict[str, list[tuple[int, float]]]:
    """teacher_forced over TEXT's first POSITIONS tokens in prompt steps of CHUNK, one engine per variant (its
    LLM keywords: e.g. {"int8": {"kv_cache_dtype": "int8"}}), each alone in turn."""
    rows: dict[str, list[tuple[int, float]]] = {}
    ids: list[int] = []
    for name, options in variants.items():
        llm = LLM(model, max_num_batched_tokens=chunk, num_threads=threads, enable_prefix_caching=False, **options)
        ids = ids or llm.get_tokenizer().encode(TEXT)[:positions]
        rows[name] = teacher_forced(llm, ids, chunk)
        llm.close()
    return rows


def run(model: str, dtype: str, ids: list[int], chunk: int, max_tokens: int, threads: int | None) -> dict:
    llm = LLM(model, kv_cache_dtype=dtype, num_threads=threads, max_num_batched_tokens=chunk,
              enable_prefix_caching=False)
    forced = teacher_forced(llm, ids, chunk)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    answers = [list(o.outputs[0].token_ids) for o in
               llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)]
    kv_bytes = llm.engine.backend.key_caches[0].nbytes / llm.engine.num_blocks / llm.engine.block_size
    llm.close()
    return {"forced": forced, "answers": answers, "kv_bytes_per_token_per_layer": 2 * kv_bytes}


def compare(ref: dict, got: dict) -> dict:
    top_ref = np.array([t for t, _ in ref["forced"]])
    top_got = np.array([t for t, _ in got["forced"]])
    lp_ref = np.array([lp for _, lp in ref["forced"]])
    lp_got = np.array([lp for _, lp in got["forced"]])
    diff = np.abs(lp_got - lp_ref)
    firsts = []
    for a, b in zip(ref["answers"], got["answers"]):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {
        "positions": int(len(top_ref)),
        "top1_agreement": float(np.mean(top_ref == top_got)),
        "max_logprob_change": float(diff.max()),
        "mean_logprob_change": float(diff.mean()),
        "greedy_identical": f"{len(ref['answers']) - len(firsts)}/{len(ref['answers'])}",
        "first_difference_at": firsts,
        "kv_bytes_ratio": got["kv_bytes_per_token_per_layer"] / ref["kv_bytes_per_token_per_layer"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--reference", default="float16")
    ap.add_argument("--candidates", default="int8,float32")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per step)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    probe = LLM(args.model, num_threads=args.threads)
    ids = probe.get_tokenizer().encode(TEXT)
    probe.close()
    results = {"model": args.model, "reference": args.reference, "text_tokens": len(ids)}
    ref = run(args.model, args.reference, ids, args.chunk, args.max_tokens, args.threads)
    for dtype in args.candidates.split(","):
        results[dtype] = compare(ref, run(args.model, dtype, ids, args.chunk, args.max_tokens, args.threads))
    print(f"{args.model}: {len(ids)} teacher-forced positions, {len(PROMPTS)} greedy answers of up to "
          f"{args.max_tokens} tokens; reference KV {args.reference}")
    print("| KV | bytes/token vs ref | top-1 agreement | max / mean |logprob change| | greedy identical | first diff |")
    print("|---|---:|---:|---:|---:|---|")
    for dtype in args.candidates.split(","):
        r = results[dtype]
        print(f"| {dtype} | {r['kv_bytes_ratio']:.3f} | {r['top1_agreement']:.4f} | {r['max_logprob_change']:.4f} / "
              f"{r['mean_logprob_change']:.5f} | {r['greedy_identical']} | {r['first_difference_at']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
