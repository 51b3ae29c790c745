"""Throughput with a JSON-schema constraint on every request vs unconstrained, side by side in one run, at
several batch sizes; plus the schema's compile time and the mask cost per step (docs/performance.md).

    python -m benchmarks.bench_structured [MODEL] [--batches 1,16,64] [--max-tokens 32] [--repeat 2] [--out FILE.json]

MODEL defaults to the embedded SmolLM2-135M-Instruct. Each batch size runs unconstrained and constrained
requests alternately (`repeat` times each, who goes first alternating, best of), the same prompts, sampled (temperature 1, seeded,
EOS ignored), so both sides generate up to max_tokens tokens per request; throughput = output tokens / s.
A constrained request may end sooner (its grammar complete): that is counted as it is. Also reported:
tokens per CPU-second of this process (ONNX Runtime's threads included), which a loaded machine disturbs less.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from octavo import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"type": "string"}}, "required": ["name", "role"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "genre", "cast", "summary"],
}
PROMPT = ("<|im_start|>user\nDescribe a film as JSON with title, year, genre, cast and a long summary "
          "(request {i}).<|im_end|>\n<|im_start|>assistant\n")


def run(llm: LLM, batch: int, max_tokens: int, constrained: bool) -> tuple[float, float, int]:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)
              for i in range(batch)]
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate([PROMPT.format(i=i) for i in range(batch)], params, use_tqdm=False)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return dt, dc, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    model = a.model
    if model is None:
        from octavo.export.embedded import default_model_path

        model = str(default_model_path())
    batches = [int(b) for b in a.batches.split(",")]
    llm = LLM(model, max_num_seqs=max(batches), enable_prefix_caching=True)
    eng = llm.engine
    t = time.perf_counter()
    eng.structured.compiler.llg_tokenizer()
    bridge = time.perf_counter() - t
    t = time.perf_counter()
    eng.structured.compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    compile_s = time.perf_counter() - t
    run(llm, 2, 4, False)  # warm-up (sessions, caches)
    rows = []
    for b in batches:
        best = {False: 0.0, True: 0.0}
        best_cpu = {False: 0.0, True: 0.0}
        toks = {False: 0, True: 0}
        m0 = (eng.structured.masks.rows, eng.structured.masks.fill_seconds, eng.structured.masks.wait_seconds)
        for r in range(a.repeat):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):  # alternate who goes first
                dt, dc, n = run(llm, b, a.max_tokens, constrained)
                if n / dt > best[constrained]:
                    best[constrained], toks[constrained] = n / dt, n
                best_cpu[constrained] = max(best_cpu[constrained], n / dc)
        ms = eng.structured.masks
        rows_masked = ms.rows - m0[0]
        row = {"batch": b, "unconstrained_tok_s": round(best[False], 1), "constrained_tok_s": round(best[True], 1),
               "ratio": round(best[True] / best[False], 3),
               "cpu_ratio": round(best_cpu[True] / best_cpu[False], 3),  # tokens per CPU-second: less load noise
               "constrained_tokens": toks[True],
               "unconstrained_tokens": toks[False],
               "mask_us_per_row": round(1e6 * (ms.fill_seconds - m0[1]) / max(rows_masked, 1), 1),
               "mask_wait_ms_total": round(1e3 * (ms.wait_seconds - m0[2]), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": model, "max_tokens": a.max_tokens, "bridge_s": round(bridge, 3),
              "schema_compile_ms": round(1e3 * compile_s, 2), "rows": rows}
    print(json.dumps(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
