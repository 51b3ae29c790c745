"""The engines of the SLO table, each as the server command a user would run, on the same model.

    octavo     `octavo serve MODEL` with its defaults (weights, batching, KV pool); only the threads set
    llama.cpp  `llama-server` on the same GGUF (-np slots of continuous batching, --metrics), when a
               binary is given
    vllm       vLLM CPU's OpenAI server from its own venv (.venv-vllm), on an HF folder converted from
               the GGUF (benchmarks.peers.vllm), when that venv exists
    hf-naive   benchmarks.peers.hf_naive_server: transformers, one request at a time, arrival order

Every one gets the same thread count (its own flag and OMP/OPENBLAS/MKL_NUM_THREADS) and runs alone:
benchmarks/slo_capacity.py starts one, measures it, stops it, then the next. `busy_gauges` are the
Prometheus gauges (on /metrics) that count requests the server still holds, used to wait for idle.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import child_env
from benchmarks.peers.worker import thread_env

OCTAVO, LLAMA, VLLM, NAIVE = "octavo", "llama.cpp", "vllm", "hf-naive"
ENGINES = (OCTAVO, LLAMA, VLLM, NAIVE)


@dataclass(slots=True, frozen=True)
class EngineSpec:
    name: str  # the table's row label
    argv: list[str]
    env: dict[str, str]
    busy_gauges: tuple[str, ...]
    ready_timeout_s: float = 600.0  # first start may convert the model (octavo's export, vLLM's HF folder)


def octavo_engine(model: str, port: int, threads: int, extra: list[str] | None = None) -> EngineSpec:
    argv = [sys.executable, "-m", "octavo", "serve", model, "--port", str(port), "--num-threads", str(threads),
            *(extra or [])]
    return EngineSpec("octavo serve" + (" " + " ".join(extra) if extra else ""), argv, thread_env(threads),
                      ("octavo:num_requests_running", "octavo:num_requests_waiting"))


def llama_engine(binary: str, gguf: str, port: int, threads: int, *, slots: int, ctx_per_slot: int,
                 extra: list[str] | None = None) -> EngineSpec:
    from benchmarks.peers.llamacpp import server_command

    argv = server_command(binary, Path(gguf), port, slots=slots, ctx_per_slot=ctx_per_slot, threads=threads,
                          extra=["--metrics", *(extra or [])])
    return EngineSpec(f"llama.cpp llama-server -np {slots}", argv, thread_env(threads),
                      ("llamacpp:requests_processing", "llamacpp:requests_deferred"))


def vllm_engine(hf_dir: str, port: int, threads: int, python: str | None = None) -> EngineSpec:
    from benchmarks.peers.vllm import START_TIMEOUT_S, vllm_server_command

    argv, env = vllm_server_command(Path(hf_dir), port, threads, python=python)
    # vLLM's own interpreter and site-packages: octavo's PYTHONPATH must not shadow its pins
    env = {**thread_env(threads), **env, "PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}
    return EngineSpec("vLLM CPU", list(argv), env, ("vllm:num_requests_running", "vllm:num_requests_waiting"),
                      ready_timeout_s=START_TIMEOUT_S)


def naive_engine(model: str, port: int, threads: int) -> EngineSpec:
    argv = [sys.executable, "-m", "benchmarks.peers.hf_naive_server", model, "--port", str(port),
            "--threads", str(threads)]
    return EngineSpec("HF naive (one at a time)", argv, {**thread_env(threads), **child_env()},
                      ("hf_naive:num_requests_running", "hf_naive:num_requests_waiting"))


EngineFactory = Callable[[int], EngineSpec]  # port -> the engine's command on that port
