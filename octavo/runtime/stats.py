"""EngineStats: a snapshot of the engine's counters (for /metrics, benchmarks and tests)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from octavo.runtime.block_manager import BlockManager
    from octavo.runtime.scheduler import Scheduler


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
    max_loras: int = 0  # LoRA slots (0: the engine serves no adapters)
    running_loras: tuple[str, ...] = ()  # adapters of the running requests (sorted, once each)
    waiting_loras: tuple[str, ...] = ()  # adapters of the waiting ones
    # speculative decoding (vLLM's spec_decode counters; 0 without speculation)
    spec_decode_num_drafts: int = 0  # verification steps of requests that had draft tokens
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified
    spec_decode_num_accepted_tokens: int = 0  # of those, accepted
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: accepted at draft position i

    @property
    def spec_decode_acceptance_rate(self) -> float:
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens \
            if self.spec_decode_num_draft_tokens else 0.0


def engine_stats(s: Scheduler, bm: BlockManager, step_count: int, max_loras: int = 0) -> EngineStats:
    """The counters of an engine's scheduler and block manager now (MAX_LORAS: with the adapters in use)."""
    def loras(reqs: list) -> tuple[str, ...]:
        return tuple(sorted({r.params.lora_name for r in reqs if r.params.lora_name is not None})) if max_loras else ()

    return EngineStats(
        num_running=len(s.running), num_waiting=len(s.waiting),
        num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
        kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
        prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
        num_preemptions=s.num_preemptions, prompt_tokens_total=s.prompt_tokens_total,
        generation_tokens_total=s.generation_tokens_total, step_count=step_count,
        max_loras=max_loras, running_loras=loras(s.running), waiting_loras=loras(s.waiting),
        spec_decode_num_drafts=s.spec_stats.num_drafts, spec_decode_num_draft_tokens=s.spec_stats.num_draft_tokens,
        spec_decode_num_accepted_tokens=s.spec_stats.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=tuple(s.spec_stats.accepted_per_pos),
    )


@dataclass(frozen=True, slots=True)
class StatMetric:
    """How one EngineStats field is exported: the server's Prometheus name (vLLM's, under `octavo:`) and
    the Triton model's gauge name (under `octavo_`), None where that exporter leaves it out."""

    field: str
    prometheus: str | None
    triton: str | None
    counter: bool  # only grows (a Prometheus counter); else a gauge
    doc: str


# the one table of exported engine metrics (serving/metrics.py and model_repo/octavo/1/model.py read it)
ENGINE_METRICS = (
    StatMetric("num_running", "num_requests_running", "num_running", False, "Requests in the running batch."),
    StatMetric("num_waiting", "num_requests_waiting", "num_waiting", False, "Requests waiting to be scheduled."),
    StatMetric("num_free_blocks", None, "free_blocks", False,
               "KV-cache blocks free (including cached-but-unreferenced ones)."),
    StatMetric("num_total_blocks", None, "total_blocks", False, "KV-cache blocks in the pool."),
    StatMetric("kv_cache_usage", "kv_cache_usage_perc", "kv_cache_usage", False,
               "Fraction of KV-cache blocks in use (0..1)."),
    StatMetric("prefix_cache_queries", "prefix_cache_queries", None, True,
               "Prompt tokens looked up in the prefix cache."),
    StatMetric("prefix_cache_hits", "prefix_cache_hits", None, True, "Prompt tokens found in the prefix cache."),
    StatMetric("num_preemptions", "num_preemptions", "num_preemptions", True,
               "Requests preempted (blocks freed, recomputed later)."),
    StatMetric("prompt_tokens_total", "prompt_tokens", None, True, "Prompt tokens processed."),
    StatMetric("generation_tokens_total", "generation_tokens", "generation_tokens_total", True, "Tokens generated."),
    StatMetric("step_count", None, "step_count", True, "Engine steps run."),
    StatMetric("spec_decode_num_drafts", "spec_decode_num_drafts", "spec_decode_num_drafts", True,
               "Speculative decoding: verification steps of requests that had draft tokens."),
    StatMetric("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", True,
               "Speculative decoding: draft tokens proposed and verified."),
    StatMetric("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
               "spec_decode_num_accepted_tokens", True, "Speculative decoding: draft tokens accepted."),
)
