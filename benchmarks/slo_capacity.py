"""How many users each engine serves within an SLO: the seed's "N x more users than naive serving", measured.

For each engine in turn (one at a time, the same threads each): start its server on the model, find by
search the largest Poisson arrival rate of chat-sized requests at which p99 TTFT and p99 TPOT (measured
client-side from the streamed chunks) stay within the SLO, stop it. Prints the table (capacity rate,
users at the SLO by Little's law, p50/p99 TTFT and TPOT there, ratio to HF naive) and saves JSON.

    .venv/bin/python -m benchmarks.slo_capacity [--quick] [--engines octavo,llama.cpp,vllm,hf-naive]
        [--slo-ttft-ms 2000] [--slo-tpot-ms 150] [--requests 64] [--llama-server PATH] [--json FILE]

Engines: octavo serve (its defaults), llama.cpp llama-server on the same GGUF (with --llama-server PATH,
$LLAMA_SERVER, or the build of benchmarks/build_llama_server.sh when present), vLLM CPU (when .venv-vllm
exists; `make vllm`), HF naive (transformers, one request at a time). The logic is in
benchmarks/slo/ (docs/performance.md, "SLO capacity").
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.slo import engines as eng
from benchmarks.slo.run import EngineResult, RunOptions, run_engine
from benchmarks.slo.table import format_table, row_of
from benchmarks.slo.target import Slo
from benchmarks.slo.workload import ChatShape, allowed_ids

LLAMA_BUILD = Path.home() / ".cache/octavo/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"

# (requests per point, prompt range, output range, points per engine, seconds a point's arrivals may span)
FULL = (64, (64, 512), (32, 256), 6, 600.0)
QUICK = (40, (64, 256), (32, 96), 5, 90.0)


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK[0]} requests per point, prompts {QUICK[1]}, outputs {QUICK[2]}, {QUICK[3]} points, "
                        f"points up to {QUICK[4]:.0f} s: every engine in about 15 minutes on 2 cores")
    p.add_argument("--engines", default=",".join(eng.ENGINES), help=f"comma list of {', '.join(eng.ENGINES)}")
    p.add_argument("--model", default=None, help="the GGUF every engine serves (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2, help="threads per engine (default 2)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="limit on p99 TTFT (default 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=150.0, help="limit on p99 TPOT (default 150)")
    p.add_argument("--percentile", type=float, default=99.0, help="the SLO's percentile (default 99)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per point (default {FULL[0]}, quick {QUICK[0]})")
    p.add_argument("--prompt-len", type=_pair, default=None, metavar="LO,HI",
                   help=f"prompt tokens, uniform (default {FULL[1][0]},{FULL[1][1]}; "
                        f"quick {QUICK[1][0]},{QUICK[1][1]})")
    p.add_argument("--output-len", type=_pair, default=None, metavar="LO,HI",
                   help=f"output tokens, uniform (default {FULL[2][0]},{FULL[2][1]}; "
                        f"quick {QUICK[2][0]},{QUICK[2][1]})")
    p.add_argument("--max-points", type=int, default=None,
                   help=f"points per engine (default {FULL[3]}, quick {QUICK[3]})")
    p.add_argument("--max-point-s", type=float, default=None,
                   help=f"longest a point's arrivals may span; rates below requests / this are not tried "
                        f"(default {FULL[4]:.0f}, quick {QUICK[4]:.0f})")
    p.add_argument("--start-rate", type=float, default=None,
                   help="first rate (req/s) for every engine (default: 2 / the latency of one mean-sized request "
                        "alone on that engine, i.e. twice the rate at which one-at-a-time serving saturates)")
    p.add_argument("--factor", type=float, default=2.0, help="geometric step before bisection (default 2)")
    p.add_argument("--precision", type=float, default=0.15,
                   help="bisect until the lowest miss / highest pass <= 1 + this (default 0.15)")
    p.add_argument("--no-stop-early", action="store_true", help="run every point to the end even once it has missed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server",
                   default=os.environ.get("LLAMA_SERVER") or (str(LLAMA_BUILD) if LLAMA_BUILD.is_file() else None),
                   help="llama-server binary (default $LLAMA_SERVER, or benchmarks/build_llama_server.sh's build)")
    p.add_argument("--llama-np", type=int, default=16, help="llama-server -np slots (default 16)")
    p.add_argument("--vllm-python", default=None,
                   help="the interpreter that has vLLM (default .venv-vllm/bin/python; `make vllm` makes it)")
    p.add_argument("--octavo-args", default="", help="extra `octavo serve` flags (one string)")
    p.add_argument("--workdir", type=Path,
                   default=Path(os.environ.get("OCTAVO_PERF_DIR", Path.home() / ".cache/octavo/perf")),
                   help="where model conversions (the HF folder vLLM and HF naive serve) are kept")
    p.add_argument("--json", type=Path, default=None, help="save the result here (default: slo-<date>.json in workdir)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.requests = args.requests or preset[0]
    args.prompt_len = args.prompt_len or preset[1]
    args.output_len = args.output_len or preset[2]
    args.max_points = args.max_points or preset[3]
    args.max_point_s = args.max_point_s or preset[4]
    return args


def factories(args: argparse.Namespace, model: str, notes: list[str]) -> list[tuple[str, Any]]:
    """(engine, port -> EngineSpec) for each engine asked for that can run here; the others get a note."""
    out = []
    ctx = -(-(args.prompt_len[1] + args.output_len[1] + 8) // 256) * 256
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if name == eng.OCTAVO:
            out.append((name, partial(eng.octavo_engine, model, threads=args.threads, extra=args.octavo_args.split())))
        elif name == eng.LLAMA:
            if not args.llama_server or not Path(args.llama_server).is_file():
                notes.append("llama.cpp not run: no llama-server binary (--llama-server PATH, $LLAMA_SERVER, or "
                             "`make llama-server`)")
                continue
            out.append((name, partial(eng.llama_engine, args.llama_server, model, threads=args.threads,
                                      slots=args.llama_np, ctx_per_slot=ctx)))
        elif name == eng.VLLM:
            from benchmarks.peers.vllm import missing_reason

            why = missing_reason(args.vllm_python)
            if why is not None:
                notes.append(f"vLLM not run: {why}")
                continue
            out.append((name, partial(_vllm, model, args.workdir, threads=args.threads, python=args.vllm_python)))
        elif name == eng.NAIVE:
            out.append((name, partial(_naive, model, args.workdir, threads=args.threads)))
        else:
            raise SystemExit(f"unknown engine {name!r}: use {', '.join(eng.ENGINES)}")
    return out


def _hf_folder(model: str, workdir: Path) -> Path:
    """What vLLM and HF naive serve: transformers' own reading of the GGUF (its dequantization), saved once as
    an HF folder (cached; the embedded model's is the folder benchmarks/compare_peers.py makes). A folder
    given as --model is served as it is."""
    from benchmarks.peers.real_model import hf_folder_from_gguf, prepare_smollm2
    from octavo.export.embedded import default_model_path

    gguf = Path(model)
    if gguf.is_dir():
        return gguf
    if gguf == default_model_path():
        real = prepare_smollm2(workdir)
        if real.hf_dir is None:
            raise RuntimeError(real.hf_error)
        hf_dir = real.hf_dir
    else:
        hf_dir = workdir / f"{gguf.stem}-{gguf.stat().st_size}-hf"
        if not (hf_dir / "config.json").is_file():
            hf_folder_from_gguf(gguf, hf_dir)
    return hf_dir


def _vllm(model: str, workdir: Path, port: int, threads: int, python: str | None) -> eng.EngineSpec:
    return eng.vllm_engine(str(_hf_folder(model, workdir)), port, threads, python)


def _naive(model: str, workdir: Path, port: int, threads: int) -> eng.EngineSpec:
    return eng.naive_engine(str(_hf_folder(model, workdir)), port, threads)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from octavo.export.embedded import default_model_path

    model = str(Path(args.model).resolve()) if args.model else str(default_model_path())
    slo = Slo(args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0, args.percentile)
    shape = ChatShape(args.requests, args.prompt_len, args.output_len, args.seed)
    opts = RunOptions(max_points=args.max_points, max_point_s=args.max_point_s, start_rate=args.start_rate,
                      factor=args.factor, precision=args.precision, stop_early=not args.no_stop_early)
    notes: list[str] = []
    todo = factories(args, model, notes)
    print(f"SLO: {slo.describe()}; {shape.describe()}; the p{slo.percentile:g} of each point is over its "
          f"{shape.num_requests} requests; up to {opts.max_points} points per engine, each point's arrivals "
          f"within {opts.max_point_s:.0f} s; {args.threads} threads per engine, one engine at a time", flush=True)
    ids = allowed_ids(model)
    started = time.time()
    load0 = os.getloadavg()[0]
    results: list[EngineResult] = []
    for name, make in todo:
        print(f"--- {name}", flush=True)
        r = run_engine(name, make, shape, ids, slo, opts, one_at_a_time=name == eng.NAIVE)
        results.append(r)
        print(f"{r.engine}: {row_of(r).how} ({r.wall_s:.0f} s)", flush=True)
    naive = next((r.engine for r in results if r.command and "hf_naive_server" in r.command), None)
    table = format_table(results, naive)
    print()
    print(table)
    for n in notes:
        print("note:", n)
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "wall_s": time.time() - started,
        "machine": f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
        "load_average_before_after": [load0, os.getloadavg()[0]], "model": model, "threads": args.threads,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "percentile": slo.percentile, "text": slo.describe()},
        "workload": {"num_requests": shape.num_requests, "prompt": shape.prompt, "output": shape.output,
                     "seed": shape.seed, "text": shape.describe()},
        "options": {"max_points": opts.max_points, "max_point_s": opts.max_point_s, "start_rate": opts.start_rate,
                    "factor": opts.factor, "precision": opts.precision, "stop_early": opts.stop_early,
                    "quick": args.quick, "llama_np": args.llama_np},
        "engines": [r.to_dict() for r in results], "naive_engine": naive, "table": table, "notes": notes,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    out = args.json or args.workdir / f"slo-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(started))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"saved {out}")
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
