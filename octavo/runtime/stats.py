"""EngineStats: a snapshot of the engine's counters (for /metrics, benchmarks and tests)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # 0..1: fraction of blocks referenced by live requests
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from it
    num_preemptions: int
    prompt_tokens_total: int  # prompt tokens computed (cache hits excluded, recomputes included)
    generation_tokens_total: int  # tokens sampled
    step_count: int
