"""vLLM's metric names on /metrics, for the routers and autoscalers that read them.

llm-d's endpoint picker (Gateway API Inference Extension), vLLM's production-stack router, KServe and KEDA
dashboards pick and scale replicas from `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:cache_config_info` (block size, number of blocks) and `vllm:lora_requests_info`.
`VllmMetrics` re-exports the server's own `octavo:*` families under vLLM's names and labels at scrape time — the
same samples, so the two sets can never disagree — and adds the two info gauges:

- every engine family gets vLLM's labels `model_name` and `engine` ("0": one engine per server);
- `octavo:request_failure{reason}` folds into `vllm:request_success{finished_reason="error"}` (vLLM counts errors
  there); `octavo:http_requests_in_flight` has no vLLM counterpart and is left out;
- `vllm:cache_config_info{block_size, num_gpu_blocks, cache_dtype, enable_prefix_caching, ...} 1` (vLLM's
  CacheConfig fields as label strings; present once the model is loaded);
- `vllm:lora_requests_info{max_lora="0", running_lora_adapters="", waiting_lora_adapters=""}` set to the scrape
  time, as vLLM sets it (pickers take the newest sample): no adapters until octavo serves LoRA.

`--metric-names` picks what /metrics shows: `both` (the default: routers work unconfigured and dashboards built
on `octavo:*` keep working; the cost is a second copy of ~20 series), `vllm` or `octavo`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

METRIC_NAME_SETS = ("both", "vllm", "octavo")
OURS, THEIRS = "octavo:", "vllm:"
ENGINE = "0"  # vLLM's engine label: the data-parallel engine index (one engine per octavo server)
SKIPPED = frozenset({"octavo:http_requests_in_flight"})
FAILURE, SUCCESS = "octavo:request_failure", "octavo:request_success"

CacheInfo = Callable[[], "dict[str, str] | None"]


class VllmMetrics(Collector):
    """The octavo families of SOURCE (also as they are, with INCLUDE_OURS) plus their vLLM-named copies."""

    def __init__(self, source: CollectorRegistry, cache_info: CacheInfo, *, include_ours: bool) -> None:
        self._source = source
        self._cache_info = cache_info
        self._include_ours = include_ours

    def collect(self) -> Iterator[Metric]:
        ours = list(self._source.collect())
        if self._include_ours:
            yield from ours
        failures = [s for family in ours if family.name == FAILURE for s in family.samples
                    if s.name.endswith("_total")]
        for family in ours:
            if family.name in SKIPPED or family.name == FAILURE or not family.name.startswith(OURS):
                continue
            renamed = _renamed(family)
            if family.name == SUCCESS:  # vLLM counts errors among its finished reasons
                model = renamed.samples[0].labels["model_name"] if renamed.samples else ""
                renamed.samples.append(Sample(f"{THEIRS}request_success_total",
                                              {"model_name": model, "engine": ENGINE, "finished_reason": "error"},
                                              sum(s.value for s in failures)))
            yield renamed
        info = self._cache_info()
        if info is not None:
            g = GaugeMetricFamily(f"{THEIRS}cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=[*info, "engine"])
            g.add_metric([*info.values(), ENGINE], 1.0)
            yield g
        lora = GaugeMetricFamily(f"{THEIRS}lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        lora.add_metric(["0", "", ""], time.time())
        yield lora

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names depend on the source's families: nothing to check at registration


def _renamed(family: Metric) -> Metric:
    copy = Metric(THEIRS + family.name[len(OURS):], family.documentation, family.type, family.unit)
    copy.samples = [Sample(THEIRS + s.name[len(OURS):], {**s.labels, "engine": ENGINE}, s.value, s.timestamp,
                           s.exemplar) for s in family.samples]
    return copy


def exposed_registry(source: CollectorRegistry, metric_names: str, cache_info: CacheInfo) -> CollectorRegistry:
    """What /metrics renders for METRIC_NAMES (one of METRIC_NAME_SETS): SOURCE itself for "octavo", else a
    registry that derives vLLM's names from it."""
    if metric_names not in METRIC_NAME_SETS:
        raise ValueError(f"metric_names must be one of {', '.join(METRIC_NAME_SETS)}, got {metric_names!r}")
    if metric_names == "octavo":
        return source
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmMetrics(source, cache_info, include_ours=metric_names == "both"))
    return registry


def cache_config_info(block_size: int, num_blocks: int, cache_dtype: str, enable_prefix_caching: bool,
                      kv_cache_memory: int | None) -> dict[str, str]:
    """vLLM's CacheConfig fields as metrics_info() writes them (str of each value), for what octavo has."""
    return {
        "block_size": str(block_size),
        "cache_dtype": cache_dtype,
        "enable_prefix_caching": str(enable_prefix_caching),
        "num_gpu_blocks": str(num_blocks),
        "num_cpu_blocks": "None",
        "kv_cache_memory_bytes": str(kv_cache_memory),
        "kv_cache_size_tokens": str(num_blocks * block_size),
        "prefix_caching_hash_algo": "blake2b",
    }
