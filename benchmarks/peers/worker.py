"""Run one peer over a list of workloads in this process: `python -m benchmarks.peers.worker SPEC OUT`.

SPEC (JSON): {"peer": ..., "threads": int, "paths": {...}, "workloads": [IdWorkload dicts], "options": {...}}.
OUT receives a JSON list of PeerResult dicts. A peer that fails on a workload gets a result with `error`
set and the worker goes on; `run_worker` (the parent side) turns a crashed worker into such results too.
Each peer gets its own process so that thread pools, allocators and caches of one never slow another.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import child_env
from benchmarks.peers.memory import own_peak_mib
from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult

PEERS = ("hf", "hf-margins", "genai", "octavo", "llamacpp", "vllm", "octavo-online", "llamacpp-online")


def thread_env(threads: int) -> dict[str, str]:
    """Pin every library's thread count (OpenMP, OpenBLAS, MKL) before anything is imported."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}


def _failed(name: str, workload: IdWorkload, exc: BaseException | str) -> PeerResult:
    msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return PeerResult(name, workload.name, len(workload.requests), workload.prompt_tokens, error=str(msg)[:500])


def _each(name: str, workloads: list[IdWorkload], fn: Any) -> list[PeerResult]:
    out = []
    for w in workloads:
        try:
            out.append(fn(w))
        except Exception as exc:  # noqa: BLE001 - one workload's failure is reported, the others still run
            traceback.print_exc()
            out.append(_failed(name, w, exc))
    return out


def run_peer(spec: dict[str, Any]) -> list[PeerResult]:
    peer, threads, paths, opts = spec["peer"], int(spec["threads"]), spec["paths"], spec.get("options", {})
    workloads = [IdWorkload.from_dict(w) for w in spec["workloads"]]
    if peer == "hf":
        from benchmarks.peers import hf

        t0 = time.perf_counter()
        model = hf.load(Path(paths["hf"]), threads)
        load_s = time.perf_counter() - t0
        hf.warm_up(model)
        out = []
        seq = opts.get("sequential", True)  # True, False or the names of the workloads to run it on
        seq_workloads = [w for w in workloads if seq is True or (isinstance(seq, list) and w.name in seq)]
        out += _each("hf-sequential", seq_workloads, lambda w: hf.run_sequential(model, w))
        if opts.get("static", True):
            out += _each("hf-static-batch", workloads,
                         lambda w: hf.run_static(model, w, opts.get("batch") or len(w.requests)))
        for r in out:
            r.extra.setdefault("load_s", load_s)
        return out
    if peer == "hf-margins":  # options.sequences: prompt + agreed prefix of each divergence
        from benchmarks.peers import hf

        model = hf.load(Path(paths["hf"]), threads)
        margins = hf.top2_margins(model, opts["sequences"])
        return [PeerResult("hf-margins", "-", extra={"margins": margins})]
    if peer == "genai":
        from benchmarks.peers import ortgenai

        t0 = time.perf_counter()
        loaded = ortgenai.load(Path(paths["genai"]), threads)
        load_s = time.perf_counter() - t0
        ortgenai.warm_up(loaded)
        out = _each(ortgenai.NAME, workloads, lambda w: ortgenai.run(
            loaded, w, opts.get("batch") or min(len(w.requests), ortgenai.MAX_BATCH)))
        for r in out:
            r.extra.setdefault("load_s", load_s)
        return out
    if peer == "octavo":
        from benchmarks.peers import octavo_peer

        caching = bool(opts.get("prefix_caching", True))
        kv = str(opts.get("kv_cache_dtype", "auto"))
        name = opts.get("name") or ("octavo" if caching else "octavo (no prefix cache)")
        return _each(name, workloads, lambda w: octavo_peer.run_offline(
            Path(paths["octavo"]), w, threads=threads, prefix_caching=caching, name=name,
            max_num_seqs=opts.get("max_num_seqs", 64), profile=bool(opts.get("profile")), kv_cache_dtype=kv,
            weights=opts.get("weights"), quant_kernel=opts.get("quant_kernel"),
            prompt_activations=str(opts.get("prompt_activations", "float32")),
            decode_activations=str(opts.get("decode_activations", "int16"))))
    if peer == "octavo-online":
        from benchmarks.peers import octavo_peer

        return _each("octavo serve", workloads, lambda w: octavo_peer.run_online(
            Path(paths["octavo"]), w, threads=threads, rate=float(opts["rate"]), max_num_seqs=opts.get("max_num_seqs", 64)))
    if peer in ("llamacpp", "llamacpp-online"):
        from benchmarks.peers import llamacpp

        binary, gguf, slots = paths["llama_server"], Path(paths["gguf"]), int(opts.get("slots", 64))
        extra = list(opts.get("extra_args") or [])
        if peer == "llamacpp":
            name = opts.get("name") or (f"{llamacpp.NAME} -np {slots}" if opts.get("label_slots") else llamacpp.NAME)
            return _each(name, workloads, lambda w: llamacpp.run_offline(
                binary, gguf, w, threads=threads, slots=slots, extra_args=extra, name=name))
        return _each(llamacpp.NAME, workloads, lambda w: llamacpp.run_online(
            binary, gguf, w, threads=threads, slots=slots, rate=float(opts["rate"]), extra_args=extra))
    if peer == "vllm":  # one server for all the workloads (it is slow to start)
        from benchmarks.peers import vllm

        name = opts.get("name") or vllm.NAME
        try:
            return vllm.run_workloads(Path(paths["vllm_model"]), workloads, threads=threads, python=paths.get("vllm_python"),
                                      name=name, dtype=str(opts.get("dtype", "float32")))
        except Exception as exc:  # noqa: BLE001 - the server did not start: every workload says why
            traceback.print_exc()
            return [_failed(name, w, exc) for w in workloads]
    raise ValueError(f"unknown peer {peer!r}; one of {', '.join(PEERS)}")


def run_worker(spec: dict[str, Any], workdir: Path, timeout_s: float, label: str) -> list[PeerResult]:
    """Parent side: run the worker in a subprocess; a crash or timeout becomes error results."""
    workloads = [IdWorkload.from_dict(w) for w in spec["workloads"]]
    spec_path, out_path = workdir / f"spec-{label}.json", workdir / f"result-{label}.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, **thread_env(int(spec["threads"])), **child_env()}
    cmd = [sys.executable, "-m", "benchmarks.peers.worker", str(spec_path), str(out_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [_failed(label, w, f"did not finish within {timeout_s:.0f} s") for w in workloads]
    if proc.returncode != 0 or not out_path.is_file():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [_failed(label, w, f"worker exited with {proc.returncode}: {tail[:300]}") for w in workloads]
    return [PeerResult.from_dict(d) for d in json.loads(out_path.read_text())]


def main(argv: list[str]) -> int:
    """Run the spec's peer and write its results. Peak RSS (extra["peak_rss_mib"]): a peer that ran in a
    server (llama-server, `octavo serve`, vLLM) has set it already, to the server's own (memory.ServerPeak).
    An in-process peer gets this worker's VmHWM (memory.own_peak_mib): interpreter, imports, model and
    pools, the largest over all of its workloads. Not getrusage's ru_maxrss: on Linux that carries the
    parent's peak across exec, and it made every peer read the same 1979 MiB."""
    spec = json.loads(Path(argv[0]).read_text())
    results = run_peer(spec)
    peak = own_peak_mib()
    for r in results:
        r.extra.setdefault("peak_rss_mib", peak)
    Path(argv[1]).write_text(json.dumps([r.to_dict() for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
