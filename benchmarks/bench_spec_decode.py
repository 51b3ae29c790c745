"""Single-user decode speed with and without speculative decoding, octavo beside llama-server, in one run.

    python -m benchmarks.bench_spec_decode [--model smollm2-135m-instruct] [--weights fp32] [--max-tokens 384]
        [--num-threads 2] [--speculative-config JSON ...] [--decode-activations int16 --decode-activations int8]
        [--llama-server PATH [--gguf FILE] [--llama-spec "ARGS" ...]] [--draft-gguf FILE] [--json out.json]

Two workloads, each request alone (batch 1, greedy, the model's own end of sequence): "repeat" (the answer
repeats or edits a text given in the prompt: quote a paragraph, return a code file, re-spell a paragraph;
65-260 tokens of answer from SmolLM2) and "chat" (unrepetitive answers). Every engine gets the same token ids
(octavo's chat template), so the comparison is the same work.

Per configuration and workload: **decode tok/s**, the rate after the first token (octavo: sum of tokens - 1
over the sum of last token - first token; llama-server: its own `predicted_per_second`, its generation time after
the prompt, which counts the first token too, so it reads up to 1/n higher than octavo's rule would), the
end-to-end rate (tokens over the wall time of the requests, prefill included), and the drafts' acceptance.
Ratios are to octavo without speculation, and octavo's greedy tokens must equal its own without speculation.

octavo's configurations: no speculation, then each --speculative-config (default: n-gram with 4, 8 and 16
draft tokens, lookup 2..4). --draft-gguf FILE adds `{"model": FILE, "num_speculative_tokens": 4}` for octavo
and `--spec-type draft-simple -md FILE` for llama-server. Each --decode-activations (default: int16 alone) runs
all of octavo's configurations again with that EngineArgs.decode_activations (int8: decode and verification on
int8 activations, as llama.cpp multiplies); tokens are checked against that mode's own run without speculation.

llama-server (with --llama-server; the GGUF is the embedded model's file or --gguf): no speculation, then each
--llama-spec (its command-line arguments; default: its n-gram kinds at a few draft lengths), and the best
of those is reported as its "best speculation".
"""
from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any

from octavo import LLM, SamplingParams

PROSE = ("The engine keeps a paged KV cache: fixed-size blocks and a block table per sequence. Requests join and "
         "leave the batch every step, and long prompts are prefilled in chunks beside running decodes. A prefix "
         "cache lets requests that share a system prompt reuse its blocks instead of computing them again. When "
         "memory runs short, the scheduler preempts the newest request, frees its blocks and recomputes them later. "
         "Sampling happens on the host: temperature, top-p, top-k, penalties and a grammar mask for structured "
         "outputs. Each step writes one record to the trace, so the timeline shows which requests ran, how many "
         "tokens each computed and how long the model took. The server speaks the OpenAI API, streams tokens as "
         "server-sent events and reports its metrics in the Prometheus format, so the dashboards users already run "
         "keep working unchanged.")
CODE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load_items(path):
    with open(path) as f:
        rows = json.load(f)
    return [Item(r["name"], float(r["price"]), int(r["quantity"])) for r in rows]


def total(items):
    result = 0
    for item in items:
        result += item.price * item.quantity
    return result


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def report(items):
    lines = []
    for item in items:
        lines.append(f"{item.name}: {item.quantity} x {item.price:.2f}")
    lines.append(f"total: {total(items):.2f}")
    return "\\n".join(lines)
'''
AMERICAN = ("The color of the theater's curtains was analyzed by the organization's team, who realized that the "
            "fabric had been dyed with a gray pigment. They traveled to the center of the city to apologize to the "
            "neighbors, whose favorite program had been canceled. The catalog listed every defense the labor union "
            "had organized, and the modeling of the traveler's behavior was recognized as an honor by the "
            "program's sponsors.")
WORKLOADS = {
    "repeat": ["Repeat the following text exactly, word for word:\n\n" + PROSE,
               "Here is a Python file:\n\n```python\n" + CODE + "```\n\nReturn the whole file unchanged.",
               "Rewrite this paragraph with British spelling, changing nothing else:\n\n" + AMERICAN],
    "chat": ["Write a short poem about the sea.", "Give three tips for learning a new language.",
             "Explain what a hash table is to a child."],
}


def ngram(k: int) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2})


DEFAULT_SPECS = [ngram(4), ngram(8), ngram(16)]
LLAMA_SPECS = [  # llama-server's self-speculation (no draft model): its n-gram kinds, a few draft lengths
    "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8 --spec-draft-n-max 8",
    "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16 --spec-draft-n-max 16",
    "--spec-type ngram-simple --spec-draft-n-max 64",
    "--spec-type ngram-map-k --spec-ngram-map-k-size-n 3 --spec-ngram-map-k-size-m 16 --spec-draft-n-max 16",
    "--spec-type ngram-mod",
    "--spec-type ngram-cache --spec-draft-n-max 8",
]


def prompts_ids(llm: LLM) -> dict[str, list[list[int]]]:
    tok = llm.get_tokenizer()
    return {w: [tok.encode_chat([{"role": "user", "content": p}]) for p in ps] for w, ps in WORKLOADS.items()}


def summarize(tokens: list[int], decode_s: list[float], wall_s: list[float], drafted: int, accepted: int,
              ids: list[list[int]] | None = None) -> dict[str, Any]:
    steps = sum(max(n - 1, 0) for n in tokens)
    out: dict[str, Any] = {"tokens": tokens, "decode_tok_s": steps / sum(decode_s) if sum(decode_s) > 0 else None,
                           "e2e_tok_s": sum(tokens) / sum(wall_s), "seconds": sum(wall_s),
                           "acceptance_rate": accepted / drafted if drafted else None, "draft_tokens": drafted}
    if ids is not None:
        out["ids"] = ids
    return out


def measure_octavo(model: str, spec: str | None, prompts: dict[str, list[list[int]]] | None, max_tokens: int,
                   threads: int | None, weights: str | None,
                   decode_activations: str = "int16") -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    """(results per workload, the prompts' token ids: PROMPTS, or made with this model's chat template)."""
    llm = LLM(model, speculative_config=spec, num_threads=threads, weights=weights,
              decode_activations=decode_activations)
    prompts = prompts if prompts is not None else prompts_ids(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    out: dict[str, Any] = {}
    for name, ps in prompts.items():
        before = llm.engine.stats()
        tokens, decode_s, wall_s, ids = [], [], [], []
        for p in ps:
            t = time.perf_counter()
            r = llm.generate([p], params, use_tqdm=False)[0]
            wall_s.append(time.perf_counter() - t)
            o = r.outputs[0]
            tokens.append(len(o.token_ids))
            ids.append(list(o.token_ids))
            m = r.metrics
            decode_s.append((m.last_token_time - m.first_token_time)
                            if m.last_token_time is not None and m.first_token_time is not None else 0.0)
        after = llm.engine.stats()
        out[name] = summarize(tokens, decode_s, wall_s,
                              after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                              after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens, ids)
    llm.engine.close()
    return out, prompts


def measure_llama(binary: str, gguf: Path, extra: list[str], prompts: dict[str, list[list[int]]], max_tokens: int,
                  threads: int) -> dict[str, Any]:
    import urllib.request

    from benchmarks.peers.llamacpp import server_command
    from benchmarks.peers.online import free_port, server_process

    port = free_port()
    ctx = max(len(p) for ps in prompts.values() for p in ps) + max_tokens + 64
    cmd = server_command(binary, gguf, port, slots=1, ctx_per_slot=ctx, threads=threads, extra=extra)
    base = f"http://127.0.0.1:{port}"

    def complete(prompt: list[int], n: int) -> dict[str, Any]:
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0, "return_tokens": True,
                           "cache_prompt": False, "stream": False}).encode()
        req = urllib.request.Request(f"{base}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as resp:
            return json.loads(resp.read())

    out: dict[str, Any] = {"command": " ".join(cmd)}
    with server_process(cmd, base):
        complete([1, 2, 3, 4], 4)  # warm up
        for name, ps in prompts.items():
            tokens, decode_s, wall_s, drafted, accepted = [], [], [], 0, 0
            for p in ps:
                t = time.perf_counter()
                body = complete(p, max_tokens)
                wall_s.append(time.perf_counter() - t)
                timings = body.get("timings") or {}
                n = int(timings.get("predicted_n", body.get("tokens_predicted", 0)))
                tokens.append(n)
                rate = float(timings.get("predicted_per_second") or 0.0)
                decode_s.append((n - 1) / rate if rate > 0 and n > 1 else 0.0)
                drafted += int(timings.get("draft_n", 0) or 0)
                accepted += int(timings.get("draft_n_accepted", 0) or 0)
            out[name] = summarize(tokens, decode_s, wall_s, drafted, accepted)
    return out


def row(label: str, r: dict[str, Any], base: dict[str, Any] | None) -> str:
    rate = f"{100 * r['acceptance_rate']:.0f}%" if r["acceptance_rate"] is not None else "-"
    ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base and r["decode_tok_s"] else "-"
    return (f"  {label[:78]:78s} decode {r['decode_tok_s'] or 0:6.1f} tok/s ({ratio:>6s})  e2e {r['e2e_tok_s']:6.1f}  "
            f"acceptance {rate:>4s}  tokens {sum(r['tokens'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--weights", default=None, help="the target's weight format (e.g. fp32 for a GGUF's float export)")
    ap.add_argument("--speculative-config", action="append", default=None,
                    help="an octavo configuration to compare (repeatable; default: n-gram with 4, 8, 16 drafts)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary: run it on the same file too")
    ap.add_argument("--gguf", default=None, help="the GGUF llama-server runs (default: --model's own file)")
    ap.add_argument("--llama-spec", action="append", default=None,
                    help="llama-server speculation arguments to try (repeatable; default: its n-gram kinds)")
    ap.add_argument("--draft-gguf", default=None, help="a draft model for both engines (same tokenizer)")
    ap.add_argument("--decode-activations", action="append", default=None, choices=("int16", "int8"),
                    help="octavo's decode arithmetic (repeatable: every configuration once per value; default int16)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    specs = list(args.speculative_config or DEFAULT_SPECS)
    llama_specs = [shlex.split(s) for s in (args.llama_spec or LLAMA_SPECS)]
    if args.draft_gguf:
        specs.append(json.dumps({"model": args.draft_gguf, "num_speculative_tokens": 4}))
        llama_specs.append(["--spec-type", "draft-simple", "-md", args.draft_gguf, "--spec-draft-n-max", "4"])

    result: dict[str, Any] = {"model": args.model, "weights": args.weights, "max_tokens": args.max_tokens,
                              "threads": args.num_threads, "octavo": {}, "llama-server": {}}
    prompts = None
    for mode in args.decode_activations or ["int16"]:
        prefix = "" if mode == "int16" else f"decode {mode}: "  # int16's labels as before: "none" and the JSON
        base, prompts = measure_octavo(args.model, None, prompts, args.max_tokens, args.num_threads, args.weights,
                                       mode)
        result["octavo"][prefix + "none"] = base
        for spec in specs:
            got, _ = measure_octavo(args.model, spec, prompts, args.max_tokens, args.num_threads, args.weights, mode)
            for w in WORKLOADS:
                got[w]["same_tokens"] = got[w]["ids"] == base[w]["ids"]
            result["octavo"][prefix + spec] = got
    if args.llama_server:
        if args.gguf:
            gguf = Path(args.gguf)
        elif args.model.endswith(".gguf"):
            gguf = Path(args.model)
        else:
            from octavo.export.embedded import default_model_path, is_embedded_name
            if not is_embedded_name(args.model):
                ap.error("--gguf FILE: the GGUF llama-server runs for this model")
            gguf = default_model_path()
        result["gguf"] = str(gguf)
        result["llama-server"]["none"] = measure_llama(args.llama_server, gguf, [], prompts, args.max_tokens,
                                                       args.num_threads)
        for extra in llama_specs:
            result["llama-server"][" ".join(extra)] = measure_llama(args.llama_server, gguf, extra, prompts,
                                                                    args.max_tokens, args.num_threads)

    for w in WORKLOADS:
        print(f"{w}:")
        ob = next(iter(result["octavo"].values()))[w]  # the first mode without speculation
        for label, r in result["octavo"].items():
            same = "" if label.endswith("none") else f"  same tokens: {r[w]['same_tokens']}"
            print(row(f"octavo {label}", r[w], ob) + same)
        for label, r in result["llama-server"].items():
            print(row(f"llama-server {label}", r[w], ob))
        if result["llama-server"]:
            best_o = max(r[w]["decode_tok_s"] or 0 for r in result["octavo"].values())
            best_l = max(r[w]["decode_tok_s"] or 0 for r in result["llama-server"].values())
            print(f"  best octavo / best llama-server decode: {best_o:.1f} / {best_l:.1f} = {best_o / best_l:.2f}x")
    if args.json:
        for r in result["octavo"].values():
            for w in WORKLOADS:
                r[w].pop("ids", None)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
