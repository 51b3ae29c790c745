"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP, over the real engine
(a tiny random model exported on the fly). References: octavo.LLM.generate / LLM.chat on the same export."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from engine_helpers import exported
from prometheus_client.parser import text_string_to_metric_families
from serve_process import serve_in_thread, until_idle

from octavo import LLM, SamplingParams
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.state import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer

KEY = "sk-test-key"
NAME = "tiny"
PROMPTS = ["Hello world", "The quick brown fox", "What is the capital of France?", "def fibonacci(n):",
           "Once upon a time", "Translate to French: good morning", "0123456789", "memory, paging and"]


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))  # exported once per session, shared with the engine tests


def engine_args(model_dir, **kw) -> EngineArgs:  # noqa: ANN001
    base = dict(model=str(model_dir), num_blocks=256, block_size=16, max_num_seqs=32, num_threads=1)
    base.update(kw)
    return EngineArgs(**base)


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: ANN001, ANN201
    ea = engine_args(model_dir)
    with serve_in_thread(ea, served_model_names=(NAME,), api_key=KEY, max_body_bytes=64 << 10) as s:
        yield s


@pytest.fixture(scope="module")
def llm(model_dir):  # noqa: ANN001, ANN201
    llm = LLM(str(model_dir), num_blocks=256, num_threads=1)
    yield llm
    llm.close()


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def metrics(server) -> dict[str, float]:  # noqa: ANN001
    """{sample name + sorted labels: value} of GET /metrics."""
    text = httpx.get(server.base_url + "/metrics", headers=auth()).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(server, timeout: float = 10.0) -> dict[str, float]:  # noqa: ANN001
    return until_idle(lambda: metrics(server), timeout, 0.02)


def greedy_ref(llm: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


# ------------------------------------------------------------------------------------------------
# correctness against the offline engine


def test_greedy_completions_equal_llm_generate_stream_and_not(client, llm) -> None:  # noqa: ANN001
    ref = greedy_ref(llm, PROMPTS[:4], 12)
    for prompt, want in zip(PROMPTS[:4], ref):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "length"
    # a batch of prompts in one request: one choice per prompt, in order
    r = client.completions.create(model=NAME, prompt=PROMPTS[:4], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ref
    assert r.usage.completion_tokens == 48
    assert r.usage.prompt_tokens == sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS[:4])
    # two prompts x n=2: choice index = prompt index * n + sample index
    r = client.completions.create(model=NAME, prompt=PROMPTS[:2], n=2, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [ref[0], ref[0], ref[1], ref[1]]


def test_token_id_prompt_and_chat_equal_llm(client, llm) -> None:  # noqa: ANN001
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == want[0].outputs[0].text
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 6*7?"}]
    want = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_stream_equals_nonstream_for_same_seed(client, temperature: float) -> None:  # noqa: ANN001
    kw = dict(model=NAME, max_tokens=16, temperature=temperature, seed=1234, n=2, top_p=0.95,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    whole = client.completions.create(prompt="Once upon a time", **kw)
    texts = {0: "", 1: ""}
    for ch in client.completions.create(prompt="Once upon a time", stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in whole.choices}
    msgs = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(messages=msgs, **kw)
    texts = {0: "", 1: ""}
    roles = set()
    for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            roles.add(c.delta.role)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert "assistant" in roles
    if temperature > 0:  # sampling with a seed is reproducible, and the two choices differ
        again = client.chat.completions.create(messages=msgs, **kw)
        assert [c.message.content for c in again.choices] == [c.message.content for c in whole.choices]
        assert whole.choices[0].message.content != whole.choices[1].message.content


def test_async_client_streaming_chat_and_usage(server, llm) -> None:  # noqa: ANN001
    msgs = [{"role": "user", "content": "Write an essay about computing."}]
    want = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]

    async def go() -> tuple[str, object, str]:
        c = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
        stream = await c.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                assert ch.usage is None
            else:
                usage = ch.usage
        whole = await c.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0,
                                                extra_body={"ignore_eos": True})
        await c.close()
        return text, usage, whole.choices[0].message.content

    text, usage, whole = asyncio.run(go())
    assert text == want.text == whole
    assert usage.completion_tokens == 20 and usage.total_tokens == usage.prompt_tokens + 20


def test_sse_wire_format_and_exact_shapes(server) -> None:  # noqa: ANN001
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    for o in objs[:-1]:
        assert set(o) == {"id", "object", "created", "model", "choices", "usage"} and o["usage"] is None
        assert o["object"] == "text_completion" and o["id"].startswith("cmpl-") and o["model"] == NAME
        assert set(o["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert len({o["id"] for o in objs}) == 1
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 5

    r = httpx.post(server.base_url + "/v1/chat/completions", headers=auth(), json={
        "model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3})
    o = r.json()
    assert set(o) == {"id", "object", "created", "model", "choices", "usage", "prompt_logprobs"} \
        and o["object"] == "chat.completion" and o["prompt_logprobs"] is None
    assert o["id"].startswith("chatcmpl-") and isinstance(o["created"], int)
    assert set(o["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    assert o["choices"][0]["message"]["role"] == "assistant"
    assert set(o["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    models = httpx.get(server.base_url + "/v1/models", headers=auth()).json()
    assert models["object"] == "list" and models["data"][0]["id"] == NAME and models["data"][0]["object"] == "model"
    assert httpx.get(server.base_url + "/version", headers=auth()).json()["version"]


def test_logprobs(client) -> None:  # noqa: ANN001
    r = client.completions.create(model=NAME, prompt="Hello world", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=NAME, prompt="Hello world", max_tokens=6, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert [t for x in streamed for t in x.tokens] == lp.tokens
    assert [t for x in streamed for t in x.token_logprobs] == lp.token_logprobs
    assert [t for x in streamed for t in x.text_offset] == lp.text_offset
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.logprob == pytest.approx(tok.top_logprobs[0].logprob)
        assert tok.bytes == list(tok.token.encode())


def test_stop_strings_stream_equals_whole(client, llm) -> None:  # noqa: ANN001
    full = greedy_ref(llm, ["The quick brown fox"], 24)[0]
    stop = full[8:10]  # something the greedy text is known to contain
    assert stop and full.index(stop) >= 0
    r = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="The quick brown fox", max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_echo_returns_prompt_then_completion(client, llm) -> None:  # noqa: ANN001
    want = greedy_ref(llm, ["Hello world"], 6)[0]
    r = client.completions.create(model=NAME, prompt="Hello world", max_tokens=6, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == "Hello world" + want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="Hello world", max_tokens=6, temperature=0, echo=True, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text


# ------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"model": NAME}, "prompt"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": {"a": 1}}, "prompt"),
])
def test_bad_completion_requests_are_400(server, body, param) -> None:  # noqa: ANN001
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.base_url + "/v1/completions", headers=auth(), **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and err["param"] == param


def test_chat_errors_prompt_too_long_404_413_401(server) -> None:  # noqa: ANN001
    url = server.base_url
    for body in ({"messages": []}, {"messages": [{"role": "wiz<|im_start|>", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                 {"messages": "hi"}, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5}):
        r = httpx.post(url + "/v1/chat/completions", headers=auth(), json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("messages", "top_logprobs", "max_completion_tokens")
    # prompt + max_tokens over the context (1024): the engine's PromptTooLongError -> 400
    r = httpx.post(url + "/v1/completions", headers=auth(), json={"prompt": [5 + i % 300 for i in range(900)], "max_tokens": 200})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", headers=auth(), json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(url + "/v1/nothing", headers=auth())
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(url + "/v1/completions", headers=auth(), json={"prompt": "x" * (80 << 10)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # auth: every route but /health; hmac-compared bearer key
    for path in ("/v1/models", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(url + "/health").status_code == 200  # no key needed


# ------------------------------------------------------------------------------------------------
# cancellation, load, metrics


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, client) -> None:  # noqa: ANN001
    before = wait_idle(server)
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    m = wait_idle(server)
    assert m["octavo:num_requests_running"] == 0 and m["octavo:kv_cache_usage_perc"] == 0
    aborted = m['octavo:request_success_total{finished_reason=abort}'] - before['octavo:request_success_total{finished_reason=abort}']
    generated = m["octavo:generation_tokens_total"] - before["octavo:generation_tokens_total"]
    assert aborted == 1 and generated < 900  # stopped early, not run to max_tokens


def test_load_200_requests_32_clients_third_cancelled(server, llm) -> None:  # noqa: ANN001
    _load(server, llm, total=200, clients=32, max_tokens=8, time_limit=60)


@pytest.mark.slow
def test_load_1000_requests_64_clients_third_cancelled(server, llm) -> None:  # noqa: ANN001
    _load(server, llm, total=1000, clients=64, max_tokens=32, time_limit=600)


def _load(server, llm, total: int, clients: int, max_tokens: int, time_limit: float) -> None:  # noqa: ANN001
    """TOTAL requests from CLIENTS concurrent clients, every third cancelled mid-stream; the rest must equal
    LLM.generate, and afterwards nothing runs and no KV block is held."""
    refs = dict(zip(PROMPTS, greedy_ref(llm, PROMPTS, max_tokens)))
    before = wait_idle(server)
    jobs = [(i, PROMPTS[i % len(PROMPTS)], i % 3 == 0) for i in range(total)]
    results: dict[int, str] = {}
    seen_running: list[float] = []

    async def go() -> None:
        c = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        queue: asyncio.Queue = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)

        async def worker() -> None:
            while not queue.empty():
                i, prompt, cancel = queue.get_nowait()
                if cancel:  # stream, read two chunks, hang up
                    s = await c.completions.create(model=NAME, prompt=prompt, max_tokens=400, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                    n = 0
                    async for _ in s:
                        n += 1
                        if n == 2:
                            break
                    await s.close()
                elif i % 2:
                    r = await c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   extra_body={"ignore_eos": True})
                    results[i] = r.choices[0].text
                else:
                    s = await c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                    results[i] = "".join([ch.choices[0].text async for ch in s])

        async def watch() -> None:
            while not queue.empty():
                seen_running.append(await asyncio.to_thread(lambda: metrics(server)["octavo:num_requests_running"]))
                await asyncio.sleep(0.05)

        await asyncio.wait_for(asyncio.gather(watch(), *[worker() for _ in range(clients)]), time_limit * 2)
        await c.close()

    t0 = time.monotonic()
    asyncio.run(go())
    elapsed = time.monotonic() - t0
    completed = [i for i, _, cancel in jobs if not cancel]
    assert sorted(results) == completed
    for i in completed:
        assert results[i] == refs[jobs[i][1]], f"request {i}"
    assert max(seen_running, default=0) > 1  # clients really were batched in flight
    m = wait_idle(server)
    assert m["octavo:num_requests_running"] == 0 and m["octavo:kv_cache_usage_perc"] == 0
    ok = m["octavo:request_success_total{finished_reason=length}"] - before["octavo:request_success_total{finished_reason=length}"]
    assert ok == len(completed)
    gen = m["octavo:generation_tokens_total"] - before["octavo:generation_tokens_total"]
    assert gen < len(completed) * max_tokens + (total - len(completed)) * 400  # cancelled ones stopped early
    assert elapsed < time_limit


def test_metrics_names_and_histograms(server, client) -> None:  # noqa: ANN001
    before = metrics(server)
    client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    m = metrics(server)
    for name in ("octavo:num_requests_running", "octavo:num_requests_waiting", "octavo:kv_cache_usage_perc",
                 "octavo:prefix_cache_queries_total", "octavo:prefix_cache_hits_total", "octavo:num_preemptions_total",
                 "octavo:prompt_tokens_total", "octavo:generation_tokens_total"):
        assert name in m, name
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        assert f"octavo:{h}_count" in m
    assert m["octavo:time_to_first_token_seconds_count"] == before["octavo:time_to_first_token_seconds_count"] + 1
    assert m["octavo:inter_token_latency_seconds_count"] == before["octavo:inter_token_latency_seconds_count"] + 3
    assert m["octavo:generation_tokens_total"] == before["octavo:generation_tokens_total"] + 4
    assert m["octavo:e2e_request_latency_seconds_sum"] > before["octavo:e2e_request_latency_seconds_sum"]


# ------------------------------------------------------------------------------------------------
# lifecycle: loading, failing steps


def test_health_503_while_loading_then_200(model_dir) -> None:  # noqa: ANN001
    release = threading.Event()
    ea = engine_args(model_dir, num_blocks=32)

    def slow_load() -> AsyncEngine:
        release.wait(30)
        return AsyncEngine(ea)

    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), slow_load, shutdown_timeout=2)
    s = ServerThread(srv).start(wait_ready=False)
    try:
        r = httpx.get(s.base_url + "/health")
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        release.set()
        s.call(srv.wait_ready(), 60)
        assert httpx.get(s.base_url + "/health").status_code == 200
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    finally:
        release.set()
        s.stop()


class _PoisonBackend:
    """The real ONNX Runtime backend, failing any step that holds a poison token or reaches a position
    (fault injection)."""

    def __init__(self, inner, poison: int, max_position: int) -> None:  # noqa: ANN001
        self.inner, self.poison, self.max_position = inner, poison, max_position
        self.num_blocks, self.block_size, self.vocab_size = inner.num_blocks, inner.block_size, inner.vocab_size

    def run(self, inputs):  # noqa: ANN001, ANN201
        if (inputs.input_ids == self.poison).any() or (inputs.position_ids >= self.max_position).any():
            raise RuntimeError("injected backend failure")
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()


def test_failed_step_is_500_and_server_keeps_serving(model_dir) -> None:  # noqa: ANN001
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    ea = engine_args(model_dir, num_blocks=32)
    poison = 300

    def load() -> AsyncEngine:
        inner = OnnxRuntimeBackend(model_dir, Manifest.load(model_dir), 32, 16, num_threads=1)
        return AsyncEngine(ea, backend=_PoisonBackend(inner, poison, max_position=40))

    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), load, shutdown_timeout=2)
    with ServerThread(srv) as s:
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": [5, poison, 7], "max_tokens": 4})
        assert r.status_code == 500 and "injected backend failure" in r.json()["error"]["message"]
        with httpx.stream("POST", s.base_url + "/v1/completions",
                          json={"prompt": [5, poison], "max_tokens": 4, "stream": True}) as st:
            # the prompt fails in its first step: nothing streamed yet, so a plain 500
            assert st.status_code == 500
        # a failure after the stream started: the error arrives in-band, the client raises
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)
        got = []
        with pytest.raises(openai.APIError, match="injected backend failure"):
            for ch in client.completions.create(model=NAME, prompt=[5, 6], max_tokens=80, stream=True,
                                                extra_body={"ignore_eos": True, "logit_bias": {str(poison): -100}}):
                got.append(ch.choices[0].text)
        assert got  # some text had been streamed before the failure
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True,
                                                             "logit_bias": {str(poison): -100}})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert s.server.state.engine.stats().num_free_blocks == 32


# ------------------------------------------------------------------------------------------------
# fuzz: whatever JSON arrives, the answer is 200 or a 4xx in the error shape, never a 500

_COMPLETION_KEYS = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
                    "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_p",
                    "repetition_penalty", "ignore_eos", "min_tokens", "echo", "best_of", "stop_token_ids"]
_CHAT_KEYS = [k for k in _COMPLETION_KEYS if k not in ("prompt", "logprobs", "echo", "best_of")] + [
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools"]


def _json_values():  # noqa: ANN202
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(-3, 40) | st.integers(-2**70, 2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6) | st.just(NAME))
    keys = st.sampled_from(["role", "content", "type", "text", "include_usage", "1", "x"])
    return st.one_of(scalars, st.lists(scalars, max_size=3),
                     st.dictionaries(keys, scalars | st.lists(scalars, max_size=2), max_size=3),
                     st.lists(st.dictionaries(keys, scalars, max_size=3), max_size=2))


def test_fuzzed_bodies_never_500(server) -> None:  # noqa: ANN001
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.booleans(), st.dictionaries(st.sampled_from(sorted(set(_COMPLETION_KEYS + _CHAT_KEYS))), _json_values(),
                                          max_size=6), st.booleans())
    def check(chat: bool, body: dict, valid_prompt: bool) -> None:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if valid_prompt:  # half the cases get past the prompt check, to reach the sampling fields
            body.setdefault("messages" if chat else "prompt", [{"role": "user", "content": "hi"}] if chat else "Hi")
        for k in ("max_tokens", "max_completion_tokens", "n"):  # keep valid requests short
            if isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and body[k] > 4:
                body[k] = 4
        if chat and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4  # chat's default is "until the context is full"
        r = http.post(server.base_url + path, headers=auth(), json=body, timeout=30)
        assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    with httpx.Client() as http:
        check()
    assert wait_idle(server)["octavo:kv_cache_usage_perc"] == 0


class _SlowBackend:
    """The real backend plus a fixed delay per step: stands in for a model whose steps take tens of ms."""

    def __init__(self, inner, delay: float) -> None:  # noqa: ANN001
        self.inner, self.delay = inner, delay
        self.num_blocks, self.block_size, self.vocab_size = inner.num_blocks, inner.block_size, inner.vocab_size

    def run(self, inputs):  # noqa: ANN001, ANN201
        time.sleep(self.delay)
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()


def test_event_loop_stays_responsive_while_steps_run(model_dir) -> None:  # noqa: ANN001
    """The server submits right on the event loop: if AsyncEngine's submit ever waited for a running step,
    every arrival would stall all streams for a step or more. Proven by state, not by a latency: a step is held
    (the backend waits for the test), and meanwhile a second request is queued and /health is answered; only
    then is the step released. (abort_nowait vs a held step: tests/test_async_engine.py.)"""
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    ea = engine_args(model_dir, num_blocks=128)
    held, release = threading.Event(), threading.Event()
    queued: list[str] = []

    class Held(_SlowBackend):
        def run(self, inputs):  # noqa: ANN001, ANN201 - the first step waits for the test
            held.set()
            assert release.wait(600)
            return super().run(inputs)

    def load() -> AsyncEngine:
        engine = AsyncEngine(ea, backend=Held(OnnxRuntimeBackend(model_dir, Manifest.load(model_dir), 128, 16,
                                                                 num_threads=1), 0))
        enqueue = engine._enqueue

        def watched_enqueue(group, callback) -> None:  # noqa: ANN001
            enqueue(group, callback)
            queued.append(group.request_id)

        engine._enqueue = watched_enqueue
        return engine

    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), load, shutdown_timeout=2)
    def post(out: list[httpx.Response], prompt: str) -> threading.Thread:
        body = {"prompt": prompt, "max_tokens": 2}
        return threading.Thread(target=lambda: out.append(httpx.post(s.base_url + "/v1/completions", json=body,
                                                                     timeout=120)))

    def wait_for(predicate, what: str) -> None:  # noqa: ANN001 - the deadline only bounds a failure
        deadline = time.monotonic() + 120
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    with ServerThread(srv) as s:
        first: list[httpx.Response] = []
        second: list[httpx.Response] = []
        a, b = post(first, "Hello"), post(second, "Hi")
        a.start()
        assert held.wait(120)  # the first request's step is running, and stays so until release
        b.start()
        try:  # the backend holds the step longer than any wait here: a blocked loop fails the wait, not the step
            wait_for(lambda: len(queued) == 2, "the second request to be queued while the step is held")
            with httpx.Client(timeout=60) as h:
                for _ in range(5):
                    assert h.get(s.base_url + "/health").status_code == 200
            still_held = not release.is_set()
        finally:
            release.set()
        a.join(120)
        b.join(120)
        assert still_held and len(queued) == 2, queued
        assert [r.status_code for r in first + second] == [200, 200], first + second


class _EncodeWatch:
    """Wraps a `tokenizers.Tokenizer`: tells when the real encoding of a huge text starts and ends, so a test can
    ask what else happened meanwhile (a state, not a duration). Every encode entry point is watched, so going
    back to the GIL-holding `encode` is seen too."""

    def __init__(self, inner, min_chars: int) -> None:  # noqa: ANN001
        self.inner, self.min_chars = inner, min_chars
        self.started, self.ended = threading.Event(), threading.Event()
        self.on_loop_thread: list[bool] = []

    def _watched(self, fn, texts) -> object:  # noqa: ANN001
        if not any(isinstance(t, str) and len(t) >= self.min_chars for t in texts):
            return fn()
        try:
            asyncio.get_running_loop()
            self.on_loop_thread.append(True)
        except RuntimeError:
            self.on_loop_thread.append(False)
        self.started.set()
        try:
            return fn()
        finally:
            self.ended.set()

    def encode(self, text, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN201
        return self._watched(lambda: self.inner.encode(text, *a, **kw), [text])

    def encode_batch(self, texts, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN201
        return self._watched(lambda: self.inner.encode_batch(texts, *a, **kw), texts)

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the real tokenizer's
        return getattr(self.inner, name)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_event_loop_stays_responsive_while_a_huge_prompt_is_tokenized(model_dir, route: str) -> None:  # noqa: ANN001
    """Tokenizing a ~1.5 MB prompt takes seconds; it must not freeze every other stream (and /health) for
    that long: it runs off the event loop, without holding the GIL. The prompt is then refused (too long).
    The server shares this process, so a held GIL stalls this client too. Proven by state, not by a duration:
    /health requests are answered, round trip complete, while the real tokenizer is still encoding that prompt
    (if the encode ran on the loop or held the GIL, no answer could come back before it ended)."""
    ea = engine_args(model_dir, num_blocks=64)
    watch: list[_EncodeWatch] = []

    def load() -> AsyncEngine:
        engine = AsyncEngine(ea)
        tok = engine.tokenizer
        watch.append(_EncodeWatch(tok._tok, min_chars=1 << 20))
        tok._tok = watch[0]
        return engine

    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,), max_body_bytes=4 << 20), load, shutdown_timeout=2)
    text = "The quick brown fox jumps over the lazy dog. " * 35_000
    body = {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    with ServerThread(srv) as s:
        w = watch[0]
        answer: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answer.append(httpx.post(s.base_url + route, json=body, timeout=120)))
        answered_while_encoding = 0
        with httpx.Client(timeout=60) as h:
            assert h.get(s.base_url + "/health").status_code == 200
            t.start()
            assert w.started.wait(120), "the huge prompt never reached the tokenizer"
            while not w.ended.is_set():
                assert h.get(s.base_url + "/health").status_code == 200
                answered_while_encoding += not w.ended.is_set()
        t.join()
        assert answer[0].status_code == 400 and answer[0].json()["error"]["code"] == "context_length_exceeded", answer[0].text[:300]
        assert w.on_loop_thread == [False], w.on_loop_thread  # one encode of the huge text, on a worker thread
        # blocked (on the loop, or the GIL held by `encode`): 0; here dozens, one a few ms while the encode takes s
        print(f"{route}: {answered_while_encoding} /health answers while the prompt was being encoded")
        assert answered_while_encoding >= 3, answered_while_encoding


def test_shutdown_lets_a_request_that_just_arrived_finish(model_dir) -> None:  # noqa: ANN001
    """SIGTERM right after a request was accepted on an idle server: the drain must see it (the engine's stats
    only change after its first step, here 0.3 s) and let it finish well inside the shutdown timeout."""
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    ea = engine_args(model_dir, num_blocks=64)
    stepping = threading.Event()

    class Backend(_SlowBackend):
        def run(self, inputs):  # noqa: ANN001, ANN201
            stepping.set()
            return super().run(inputs)

    def load() -> AsyncEngine:
        return AsyncEngine(ea, backend=Backend(OnnxRuntimeBackend(model_dir, Manifest.load(model_dir), 64, 16,
                                                                  num_threads=1), 0.3))

    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), load, shutdown_timeout=10)
    s = ServerThread(srv).start()
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    answer: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answer.append(httpx.post(s.base_url + "/v1/completions", json=body,
                                                                 timeout=30)))
    t.start()
    assert stepping.wait(10)  # admitted: its first step is running
    s.stop()
    t.join(30)
    assert answer and answer[0].status_code == 200, answer
    assert answer[0].json()["choices"][0]["finish_reason"] == "length", answer[0].text


def test_shutdown_aborts_what_outlives_the_timeout(model_dir) -> None:  # noqa: ANN001
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    ea = engine_args(model_dir, num_blocks=64)
    engines: list[AsyncEngine] = []

    def load() -> AsyncEngine:
        inner = OnnxRuntimeBackend(model_dir, Manifest.load(model_dir), 64, 16, num_threads=1)
        engines.append(AsyncEngine(ea, backend=_SlowBackend(inner, 0.02)))
        return engines[0]

    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), load, shutdown_timeout=0.5)
    s = ServerThread(srv).start()
    got: list[str] = []

    def stream() -> None:  # 500 tokens at >= 20 ms a step: ~10 s if it were allowed to finish
        body = {"prompt": "Hello", "max_tokens": 500, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", s.base_url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError as exc:
            got.append(f"error: {exc}")

    t = threading.Thread(target=stream)
    t.start()
    while not got and t.is_alive():
        time.sleep(0.01)
    t0 = time.monotonic()
    s.stop()
    t.join(10)
    assert time.monotonic() - t0 < 5 and not t.is_alive()
    # cut off long before its 500 tokens, but ended properly: a last chunk with finish_reason "abort", then [DONE]
    # (shutdown aborts through the engine since 00124c1; handlers are not cancelled mid-stream)
    events = [line for line in got if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 500
    stats = engines[0].engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def _threads_named(name: str) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == name and t.is_alive()}


def test_model_that_fails_to_load_leaves_no_socket_thread_or_engine(tmp_path) -> None:  # noqa: ANN001
    """A bad model folder: ServerThread.start raises the load error (503 model_load_failed, naming the folder)
    and then holds nothing: the port refuses connections, the server's loop thread is gone. (The bound
    socket and the loop thread used to stay behind: `with ServerThread(...)` never reaches __exit__.)"""
    from octavo.serving.api_error import ApiError

    bad = tmp_path / "no-such-model"
    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), lambda: AsyncEngine(EngineArgs(model=str(bad))),
                       shutdown_timeout=2)
    before = _threads_named("octavo-server")
    s = ServerThread(srv)
    with pytest.raises(ApiError) as err:
        s.start(timeout=60)
    assert err.value.status == 503 and err.value.code == "model_load_failed"
    assert str(bad) in err.value.message and "ModelFormatError" in err.value.message
    assert _threads_named("octavo-server") <= before
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.base_url + "/health", timeout=5)
    s.stop()  # harmless after a failed start


def test_engine_that_fails_to_start_is_shut_down_and_reported(model_dir) -> None:  # noqa: ANN001
    """The engine exists (backend allocated, step thread running) but starting it fails: the server shuts it
    down -- thread joined, backend closed -- and reports the error on /health and from wait_ready()."""
    from octavo.errors import BackendUnavailableError
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from octavo.serving.api_error import ApiError

    closed = threading.Event()

    class Tracked(_SlowBackend):
        def close(self) -> None:
            super().close()
            closed.set()

    class FailingStart(AsyncEngine):
        async def start(self) -> None:
            await super().start()  # the step thread runs ...
            raise BackendUnavailableError("injected: the accelerator went away during warm-up")  # ... then this

    ea = engine_args(model_dir, num_blocks=32)

    def load() -> AsyncEngine:
        inner = OnnxRuntimeBackend(model_dir, Manifest.load(model_dir), 32, 16, num_threads=1)
        return FailingStart(ea, backend=Tracked(inner, 0.0))

    before = _threads_named("octavo-engine")
    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,)), load, shutdown_timeout=2)
    s = ServerThread(srv).start(wait_ready=False)
    try:
        with pytest.raises(ApiError) as err:
            s.call(srv.wait_ready(), 60)
        assert err.value.code == "model_load_failed" and "accelerator went away" in err.value.message
        r = httpx.get(s.base_url + "/health")
        assert r.status_code == 503 and "accelerator went away" in r.json()["error"]["message"]
        assert closed.is_set(), "the backend of the engine that failed to start must be closed"
        assert _threads_named("octavo-engine") <= before, "its step thread must be stopped"
        assert srv.state.engine is None
    finally:
        s.stop()


def test_lone_surrogate_is_400_escaped_pair_is_served(server, llm) -> None:  # noqa: ANN001
    """Bodies are checked for lone surrogates on the raw JSON text (no re-serialising): an unpaired \\ud800 is a
    400 in OpenAI's shape; an emoji sent as an escaped pair (json.dumps' default) is served like the character."""
    url, headers = server.base_url + "/v1/completions", {**auth(), "Content-Type": "application/json"}
    r = httpx.post(url, headers=headers, content=b'{"model": "tiny", "prompt": "a \\ud800 b", "max_tokens": 2}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "surrogates not allowed" in err["message"]
    prompt = "smile \U0001F600 please"
    body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert "\\ud83d\\ude00" in body
    r = httpx.post(url, headers=headers, content=body.encode(), timeout=60)
    assert r.status_code == 200, r.text
    want = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
