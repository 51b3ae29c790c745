"""What routers read from a replica, as they read it from vLLM: /metrics under vLLM's names and labels (llm-d's
endpoint picker: vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc,
vllm:cache_config_info, vllm:lora_requests_info), /health and /v1/models; and the KV-event stream of a served engine,
whose stored blocks carry the tokens /tokenize gives for the prompt. Parsed with prometheus_client's own parser."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from engine_helpers import exported
from kv_event_subscriber import DECODER, Stored, Subscriber
from prometheus_client.parser import text_string_to_metric_families
from serve_process import serve_in_thread, serving, until_idle

from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.stats import EngineStats
from octavo.serving.metrics import ServerMetrics

NAME = "tiny"
KEY = "sk-router"
ENGINE_FAMILIES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                   "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
                   "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_success"]


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def flat(text: str) -> dict[str, float]:
    """{sample name{labels but model_name and engine}: value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metric_name_sets() -> None:
    """--metric-names: both (octavo:* and vllm:*, the same values), vllm only, octavo only."""
    stats = EngineStats(num_running=3, num_waiting=5, num_free_blocks=30, num_total_blocks=40, kv_cache_usage=0.25,
                        prefix_cache_queries=100, prefix_cache_hits=64, num_preemptions=2, prompt_tokens_total=36,
                        generation_tokens_total=7, step_count=9)
    both = ServerMetrics("m", lambda: stats)
    both.finished("stop")
    both.finished("error")
    both.finished("error")
    fams = families(both.render().decode())
    for name in ENGINE_FAMILIES:
        assert f"octavo:{name}" in fams and f"vllm:{name}" in fams, name
    for s in fams["vllm:num_requests_waiting"] + fams["vllm:kv_cache_usage_perc"]:
        assert s.labels == {"model_name": "m", "engine": "0"}
    values = flat(both.render().decode())
    assert values["vllm:num_requests_waiting"] == 5 and values["vllm:kv_cache_usage_perc"] == 0.25
    assert values["vllm:prefix_cache_hits_total"] == 64 and values["vllm:num_preemptions_total"] == 2
    assert values["vllm:request_success_total{finished_reason=stop}"] == 1
    assert values["vllm:request_success_total{finished_reason=error}"] == 2  # vLLM counts errors as a reason
    assert "vllm:http_requests_in_flight" not in fams and "vllm:request_failure" not in fams
    assert "vllm:cache_config_info" not in fams  # no engine yet: no cache config
    lora = fams["vllm:lora_requests_info"]
    assert [s.labels for s in lora] == [{"max_lora": "0", "waiting_lora_adapters": "", "running_lora_adapters": ""}]
    assert abs(lora[0].value - time.time()) < 60  # vLLM sets it to the time: pickers take the newest sample

    only_vllm = families(ServerMetrics("m", lambda: stats, metric_names="vllm").render().decode())
    assert not [n for n in only_vllm if n.startswith("octavo:")] and "vllm:num_requests_running" in only_vllm
    only_ours = families(ServerMetrics("m", lambda: stats, metric_names="octavo").render().decode())
    assert not [n for n in only_ours if n.startswith("vllm:")] and "octavo:num_requests_running" in only_ours
    with pytest.raises(ValueError, match="metric_names"):
        ServerMetrics("m", lambda: stats, metric_names="prometheus")


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


def test_served_replica_as_a_router_sees_it(model_dir, tmp_path) -> None:  # noqa: ANN001
    """One served engine with KV events: the openai client's usage totals are what vllm:* counts; cache_config_info
    describes the pool; /health and /v1/models answer as vLLM's; the first stored blocks of a prompt carry exactly
    the prompt's tokens (from /tokenize), in block_size chunks."""
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv",
              "replay_endpoint": f"ipc://{tmp_path}/kv-replay"}
    ea = EngineArgs(model=str(model_dir), num_blocks=64, block_size=8, max_num_seqs=8, num_threads=1,
                    kv_events_config=json.dumps(events))
    sub = Subscriber(events["endpoint"], events["replay_endpoint"])
    try:
        with serve_in_thread(ea, served_model_names=(NAME,), api_key=KEY) as server:
            base = server.base_url
            health = httpx.get(base + "/health")  # no key: probes carry none
            assert (health.status_code, health.content) == (200, b"")
            models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
            card = models["data"][0]
            assert models["object"] == "list" and card["id"] == NAME and card["object"] == "model"
            assert card["root"] == NAME and card["parent"] is None and card["max_model_len"] > 0

            client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
            prompt = "The quick brown fox jumps over the lazy dog, " * 4
            completion_tokens = prompt_tokens = 0
            for _ in range(3):  # the same prompt: the 2nd and 3rd hit the prefix cache
                r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0)
                completion_tokens += r.usage.completion_tokens
                prompt_tokens += r.usage.prompt_tokens

            def read() -> dict[str, float]:
                return flat(httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)

            m = until_idle(read, 30, 0.02)
            assert m["vllm:generation_tokens_total"] == completion_tokens
            assert m["vllm:prefix_cache_queries_total"] == prompt_tokens
            assert 0 < m["vllm:prefix_cache_hits_total"] < prompt_tokens
            assert m["vllm:request_success_total{finished_reason=length}"] == 3
            assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
            for name, value in m.items():  # the two sets are one set of samples
                if name.startswith("octavo:") and not name.endswith("_created") and "in_flight" not in name \
                        and "request_failure" not in name:
                    assert m["vllm:" + name[len("octavo:"):]] == value, name
            text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
            info = families(text)["vllm:cache_config_info"]
            assert len(info) == 1 and info[0].value == 1
            assert {k: info[0].labels[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching", "engine",
                                                    "cache_dtype")} == \
                {"block_size": "8", "num_gpu_blocks": "64", "enable_prefix_caching": "True", "engine": "0",
                 "cache_dtype": "float32"}

            ids = httpx.post(base + "/tokenize", json={"model": NAME, "prompt": prompt},
                             headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
            engine = server.server.state.engine
            assert engine is not None and engine.engine.kv_event_publisher is not None
            last = engine.engine.kv_event_publisher.published_batches - 1
            deadline = time.monotonic() + 30
            while not (batches := sub.replay(0)) or batches[-1][0] < last:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            first = next(e for _, p in batches for e in DECODER.decode(p).events if isinstance(e, Stored))
            assert first.parent_block_hash is None and first.block_size == 8
            assert first.token_ids == ids[:len(first.token_ids)] and len(first.token_ids) == 8 * (len(ids) // 8)
    finally:
        sub.close()


def test_octavo_serve_flags(model_dir, tmp_path) -> None:  # noqa: ANN001
    """`octavo serve --metric-names vllm --kv-events-config JSON`: only vLLM's names on /metrics; the events'
    publisher is up (its replay endpoint returns the engine's first batch, AllBlocksCleared)."""
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv",
              "replay_endpoint": f"ipc://{tmp_path}/kv-replay", "topic": "replica-1"}
    with serving([str(model_dir), "--port", "0", "--num-blocks", "32", "--num-threads", "1", "--metric-names", "vllm",
                  "--kv-events-config", json.dumps(events)]) as (_, url):
        names = families(httpx.get(url + "/metrics").text)
        assert "vllm:kv_cache_usage_perc" in names and "vllm:cache_config_info" in names
        assert not [n for n in names if n.startswith("octavo:")]
        sub = Subscriber(events["endpoint"], events["replay_endpoint"], b"replica-1")
        try:
            batches = sub.replay(0)
            assert batches and batches[0][0] == 0
            assert [type(e).__name__ for e in DECODER.decode(batches[0][1]).events] == ["Cleared"]
        finally:
            sub.close()
