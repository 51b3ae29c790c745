"""Prometheus metrics with vLLM's names under the `octavo:` prefix, in a per-server CollectorRegistry; /metrics also
shows them under vLLM's own `vllm:` names and labels (serving/vllm_metrics.py, `metric_names`).

Engine state (running/waiting requests, KV usage, prefix-cache and token counters, preemptions) is read
from `engine.stats()` at scrape time by a custom collector, so it can never drift from the engine.
Per-request latencies (TTFT, inter-token, end-to-end, queue time) and finish reasons are observed by
the server as outputs stream through it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from octavo.runtime.stats import ENGINE_METRICS
from octavo.serving.vllm_metrics import exposed_registry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# bucket edges in seconds (vLLM's, extended downwards for small CPU models)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

SUCCESS_REASONS = ("stop", "length", "abort")


class _EngineCollector(Collector):
    """Gauges and counters straight from EngineStats (zeros while the model is loading)."""

    def __init__(self, stats: Callable[[], Any | None], model_name: str,
                 in_flight: Callable[[], int] | None = None) -> None:
        self._stats = stats
        self._model = model_name
        self._in_flight = in_flight

    def collect(self):  # noqa: ANN201 - prometheus_client's protocol
        return self._families(self._stats(), self._in_flight() if self._in_flight is not None else 0)

    def describe(self):  # noqa: ANN201 - names only, without asking the engine
        return self._families(None, 0)

    def _families(self, s: Any | None, in_flight: int):  # noqa: ANN202
        get = (lambda name: float(getattr(s, name))) if s is not None else (lambda name: 0.0)
        labels = ["model_name"]
        # handlers running, from the headers' arrival to the last byte (the engine's gauges see a request only
        # once it is submitted: not while its body is still arriving or its prompt is being tokenized)
        g = GaugeMetricFamily("octavo:http_requests_in_flight", "HTTP requests being handled (any route).",
                              labels=labels)
        g.add_metric([self._model], float(in_flight))
        yield g
        if s is not None and getattr(s, "max_loras", 0):  # vLLM's: which adapters run and wait, as labels
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(s.max_loras), ",".join(s.running_loras), ",".join(s.waiting_loras)], time.time())
            yield info
        for m in ENGINE_METRICS:
            if m.prometheus is None:
                continue
            family = (CounterMetricFamily if m.counter else GaugeMetricFamily)(f"octavo:{m.prometheus}", m.doc,
                                                                              labels=labels)
            family.add_metric([self._model], get(m.field))
            yield family
        per_pos = CounterMetricFamily("octavo:spec_decode_num_accepted_tokens_per_pos",  # vLLM's, per draft position
                                      "Speculative decoding: draft tokens accepted at each draft position.",
                                      labels=[*labels, "position"])
        for i, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos if s is not None else ()):
            per_pos.add_metric([self._model, str(i)], float(n))
        yield per_pos


class ServerMetrics:
    """All metrics of one server; nothing global, so several servers can live in one process."""

    def __init__(self, model_name: str, stats: Callable[[], Any | None],
                 in_flight: Callable[[], int] | None = None, metric_names: str = "both") -> None:
        """METRIC_NAMES: what /metrics shows: "both", "vllm" or "octavo" (serving/vllm_metrics.py)."""
        self.model_name = model_name
        self.cache_info: dict[str, str] | None = None  # vllm:cache_config_info's labels, set once the model is loaded
        r = CollectorRegistry(auto_describe=True)  # the octavo:* families
        r.register(_EngineCollector(stats, model_name, in_flight))
        self.registry = exposed_registry(r, metric_names, lambda: self.cache_info)
        self.ttft = Histogram("octavo:time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("octavo:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("octavo:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("octavo:request_queue_time_seconds", "Time from arrival to first scheduling.",
                               ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("octavo:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._failure = Counter("octavo:request_failure", "Requests ended by an error, by kind.",
                                ["model_name", "reason"], registry=r)
        for reason in SUCCESS_REASONS:  # export zeros from the start
            self._success.labels(model_name, reason)

    def finished(self, reason: str) -> None:
        if reason in SUCCESS_REASONS:
            self._success.labels(self.model_name, reason).inc()
        else:
            self._failure.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one engine request's latencies from the outputs the server receives for it."""

    __slots__ = ("_m", "_start", "_last", "_tokens", "_done")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self._m = metrics
        self._start = start
        self._last: float | None = None
        self._tokens = 0
        self._done = False

    def output(self, now: float, num_tokens: int) -> None:
        """num_tokens: the most tokens any of the request's sequences has generated so far."""
        new = num_tokens - self._tokens
        if new <= 0:
            return
        if self._last is None:
            self._m.ttft.observe(now - self._start)
            new -= 1  # several tokens in the first output: the rest count as inter-token gaps below
            self._last = now
        if new > 0:
            gap = (now - self._last) / new
            for _ in range(new):
                self._m.itl.observe(gap)
        self._last = now
        self._tokens = num_tokens

    def finish(self, now: float, reason: str, queue_time: float | None) -> None:
        if self._done:
            return
        self._done = True
        self._m.e2e.observe(now - self._start)
        if queue_time is not None and queue_time >= 0:
            self._m.queue.observe(queue_time)
        self._m.finished(reason)
