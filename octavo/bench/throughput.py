"""`octavo bench throughput`: offline throughput through octavo.LLM (every request submitted at once)."""
from __future__ import annotations

import time
from typing import Any

from octavo.bench.report import SpecDecodeSummary, ThroughputResult
from octavo.bench.workloads import BenchRequest
from octavo.runtime.sampling_params import SamplingParams


def run_throughput(llm: Any, requests: list[BenchRequest], *, temperature: float = 0.0, seed: int = 0) -> ThroughputResult:
    """Generate every request with LLM.generate and time the whole batch (prompt tokens as the engine counted)."""
    prompts = [r.prompt if isinstance(r.prompt, str) else {"prompt_token_ids": r.prompt} for r in requests]
    params = [SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos,
                             seed=None if temperature == 0 else seed + i) for i, r in enumerate(requests)]
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return ThroughputResult(
        num_requests=len(outs), elapsed_time=elapsed,
        total_prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        total_output_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs),
        spec_decode=SpecDecodeSummary.between(before, llm.engine.stats()),
    )
