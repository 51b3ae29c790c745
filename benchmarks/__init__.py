"""octavo's lab: octavo measured beside its peers, and the micro-benchmarks behind docs/performance.md.

Not part of the octavo package (the wheel holds `octavo/` only): these drive other engines (HF transformers,
onnxruntime-genai, llama.cpp's llama-server, vLLM CPU), which a user of octavo does not need. What a user runs
against octavo itself is `octavo bench` (octavo/bench/).

Every Python entry point runs as a module from the checkout's root, e.g.

    .venv/bin/python -m benchmarks.compare_peers --quick
    .venv/bin/python -m benchmarks.slo_capacity --quick

    compare_peers.py    octavo beside its peers, one run, same model and workloads (peers/)
    slo_capacity.py     users served within a latency SLO, octavo vs peers vs naive serving (slo/)
    roofline.py         how close octavo's decode steps come to this machine's sgemm peak and bandwidth
    bench_*.py          micro-benchmarks: the op, weight formats, structured outputs, streaming, body parsing
    make_gguf.py        random-weight 1-3B Llama / Qwen3-MoE GGUFs via llama.cpp's converter and llama-quantize
    bench_embeddings.py octavo /v1/embeddings beside llama-server --embeddings on one GGUF
    build_llama_server.sh  builds the llama-server peer and llama-quantize; vllm/ and eval/ pin the vLLM and lm-eval venvs
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/ is not installed, so children need it


def child_env() -> dict[str, str]:
    """Environment additions for a child `python -m benchmarks.…`: the checkout's root first on PYTHONPATH
    (whatever the parent's PYTHONPATH held follows), so the child finds this folder from any working directory."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), *rest])}
