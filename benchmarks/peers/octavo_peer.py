"""octavo itself: offline through octavo.LLM (token-id prompts, greedy, ignore_eos), and online through
`octavo serve` in its own process. A fresh engine per workload, so no prefix cache carries over.

A workload with a shared prefix runs COLD, like every other peer's: nothing of the prefix is cached
before the timed run. Requests arriving together still compute it once: the scheduler holds a request
whose next prefix block another request is computing (docs/engine.md, "Cold shared prefixes"); the hit
count is in `extra`.

The model may be an export folder or a .gguf (octavo exports it into its cache with its own default for
GGUFs unless `weights` names one). A one-request workload also reports TTFT and decode tok/s from the
request's own metrics (first and last token times), like the HTTP peers' streamed clocks."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks.peers.memory import ServerPeak
from benchmarks.peers.online import free_port, poisson_run, server_process
from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult
from benchmarks.peers.streamed import decode_stats

BLOCK_SIZE = 16


def pool_blocks(workload: IdWorkload, block_size: int = BLOCK_SIZE) -> int:
    """Enough KV blocks for every request at once (no preemption), plus a little slack."""
    return sum(-(-(len(r.prompt) + r.max_tokens) // block_size) for r in workload.requests) + 16


def run_offline(octavo_dir: Path, workload: IdWorkload, *, threads: int, prefix_caching: bool = True,
                max_num_seqs: int = 64, name: str = "octavo", profile: bool = False,
                kv_cache_dtype: str = "auto", weights: str | None = None,
                quant_kernel: str | None = None, prompt_activations: str = "float32",
                decode_activations: str = "int16") -> PeerResult:
    t_load = time.perf_counter()  # imports included (the first workload's load is the cold start)
    from octavo.runtime.llm import LLM
    from octavo.runtime.sampling_params import SamplingParams

    chosen: dict[str, str] = {"weights": weights} if weights else {}  # None: octavo's own default for this model
    if quant_kernel:
        chosen["quant_kernel"] = quant_kernel
    llm = LLM(str(octavo_dir), num_threads=threads, max_num_seqs=max_num_seqs, block_size=BLOCK_SIZE,
              num_blocks=pool_blocks(workload), enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype,
              prompt_activations=prompt_activations, decode_activations=decode_activations, **chosen)
    load_s = time.perf_counter() - t_load
    try:
        warm = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        hits0 = llm.engine.stats().prefix_cache_hits
        prof = None
        if profile:
            from octavo.bench.profile import attach_profiler

            prof = attach_profiler(llm.engine)
        prompts = [{"prompt_token_ids": r.prompt} for r in workload.requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload.requests]
        steps0 = llm.engine.step_count
        t0, t0_wall = time.perf_counter(), time.time()  # RequestMetrics stamps tokens with time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        stats = llm.engine.stats()
    finally:
        llm.close()
    res = PeerResult(name, workload.name, len(outs), workload.prompt_tokens, elapsed_s=elapsed)
    res.outputs = [list(o.outputs[0].token_ids) for o in outs]
    res.output_tokens = res.generated_tokens = sum(len(o) for o in res.outputs)
    res.extra = {"prefix_caching": prefix_caching, "kv_cache_dtype": kv_cache_dtype, "load_s": load_s,
                 "steps": stats.step_count - steps0,
                 "prefix_cache_hit_tokens": stats.prefix_cache_hits - hits0, "max_num_seqs": max_num_seqs}
    if weights:
        res.extra["weights"] = weights
    if quant_kernel:
        res.extra["quant_kernel"] = quant_kernel
    if prompt_activations != "float32":
        res.extra["prompt_activations"] = prompt_activations
    if decode_activations != "int16":
        res.extra["decode_activations"] = decode_activations
    if len(outs) == 1:
        m = outs[0].metrics
        res.extra.update(decode_stats(len(res.outputs[0]), t0_wall, m.first_token_time, m.last_token_time))
    if prof is not None:
        res.extra["profile"] = prof.to_dict()
    return res


def run_online(octavo_dir: Path, workload: IdWorkload, *, threads: int, rate: float, seed: int = 0,
               max_num_seqs: int = 64) -> PeerResult:
    port = free_port()
    cmd = [sys.executable, "-m", "octavo", "serve", str(octavo_dir), "--port", str(port), "--num-threads", str(threads),
           "--max-num-seqs", str(max_num_seqs), "--num-blocks", str(pool_blocks(workload)),
           "--served-model-name", "perf"]
    base = f"http://127.0.0.1:{port}"
    peak = ServerPeak()  # the `octavo serve` process's own peak RSS, not this worker's
    with server_process(cmd, base, peak=peak):
        res = poisson_run("octavo serve", base, workload, rate, seed, model="perf")
    res.extra.update(peak.extra())
    return res
