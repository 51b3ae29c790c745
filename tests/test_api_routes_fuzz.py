"""The embeddings, Responses and Anthropic Messages routes under malformed input: hostile bytes and random JSON
built from those APIs' own field names always get a well-formed 4xx (or a 200), never a 500, and leave no KV
block held. One server over an embedding export (which also generates), so every route does real work."""
from __future__ import annotations

import json

import httpx
import pytest
from embedding_models import make_embedding_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from serve_process import serve_in_thread, until_idle

from octavo.export import export_model
from octavo.runtime.engine_args import EngineArgs

KEY = "sk-fuzz"
ROUTES = ["/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]
HOSTILE = [b"", b"null", b"[]", b"{", b"{}", b"\xff\xfe", b'{"input": "\\ud800"}', b'{"input": [true]}',
           b'{"input": [[1, 2], "x"]}', b'{"input": [' + b"1," * 3000 + b"1]}", b'{"messages": "x", "max_tokens": 1}',
           b'{"input": "x", "dimensions": 1e400}', b'{"input": {"$ne": 1}}', b"[" * 20000 + b"]" * 20000,
           b'{"messages": [{"role": "user", "content": [{"type": "tool_result"}]}], "max_tokens": 2}',
           b'{"input": [{"type": "function_call_output", "call_id": 1, "output": {}}]}',
           b'{"max_tokens": 2, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", '
           b'"name": "f", "input": []}]}]}']
_KEYS = ["input", "messages", "role", "content", "type", "text", "max_tokens", "max_output_tokens", "tools",
         "tool_choice", "dimensions", "encoding_format", "system", "stream", "name", "arguments", "call_id",
         "output", "instructions", "input_schema", "tool_use_id", "stop_sequences", "format", "normalize"]
_junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 70) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["user", "assistant", "system", "text", "function", "tool_use", "tool_result", "function_call",
                       "function_call_output", "json_schema", "base64", "float", "auto", "any", "", 2**64]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4),
    max_leaves=10)


@pytest.fixture(scope="module")
def server(hf_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("fuzz_emb")
    export_model(make_embedding_model(root / "st", hf_model_dir("qwen3"), "mean"), root / "model", progress=False)
    args = EngineArgs(model=str(root / "model"), num_blocks=64, block_size=16, num_threads=1)
    with serve_in_thread(args, served_model_names=("m",), api_key=KEY, max_tokens_cap=8,
                         max_body_bytes=64 << 10) as s:
        yield s


def _check(r: httpx.Response, what: object) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300], what)
    if r.status_code >= 400:
        body = r.json()
        assert "error" in body and isinstance(body["error"].get("message"), str), body


@pytest.mark.parametrize("route", ROUTES)
def test_hostile_bodies_are_4xx(server, route: str) -> None:  # noqa: ANN001
    with httpx.Client(timeout=60) as http:
        for body in HOSTILE:
            r = http.post(server.base_url + route, content=body,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            _check(r, body[:60])
            assert r.status_code >= 400 or route != "/v1/embeddings" or body.startswith(b'{"input": [1')


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=st.dictionaries(st.sampled_from(_KEYS), _junk, max_size=5),
       model=st.sampled_from([None, "m", "x"]))
def test_random_bodies_never_500(server, route: str, body: dict, model: str | None) -> None:  # noqa: ANN001
    if model is not None:
        body = {**body, "model": model}
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    with httpx.Client(timeout=60) as http:
        _check(http.post(server.base_url + route, content=data,
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}), body)


def _metrics(server) -> dict[str, float]:  # noqa: ANN001
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.labels or set(s.labels) == {"model_name"}}


def test_idle_after_fuzzing(server) -> None:  # noqa: ANN001
    r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hello", "model": "m"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    m = until_idle(lambda: _metrics(server), 15.0, 0.05)
    assert m["octavo:kv_cache_usage_perc"] == 0 and m["octavo:num_requests_running"] == 0


@pytest.mark.parametrize("mode, examples", [
    ("positive", 25), ("negative", 25),
    pytest.param("positive", 400, marks=pytest.mark.slow), pytest.param("negative", 400, marks=pytest.mark.slow)])
def test_schemathesis_on_an_embedding_export(server, mode: str, examples: int) -> None:  # noqa: ANN001
    """The OpenAPI document of an embedding export lists /v1/embeddings beside the other routes; schema-valid
    requests get documented answers, schema violations a documented 4xx, never a 500."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    headers = {"Authorization": f"Bearer {KEY}"}
    doc = httpx.get(server.base_url + "/openapi.json", headers=headers).json()
    assert doc["components"]["schemas"]["EmbeddingRequest"]["properties"]["dimensions"]["maximum"] == 64
    schema = schemathesis.openapi.from_dict(doc).include(path=ROUTES)  # the other routes: test_fuzz_server.py
    statuses: dict[tuple[str, int], int] = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(GenerationMode(mode), headers=headers))
    def check(case) -> None:  # noqa: ANN001
        case.headers = {**(case.headers or {}), **headers}
        resp = case.call(base_url=server.base_url, timeout=30)
        statuses[(case.path, resp.status_code)] = statuses.get((case.path, resp.status_code), 0) + 1
        assert resp.status_code < 500, (resp.status_code, resp.text[:400], case.path, case.body)
        # schema-valid requests may still be refused for what a schema cannot say (a prompt too long, a
        # template that refuses the roles): those are 400s naming the problem, so conformance is checked, not
        # acceptance (as tests/test_fuzz_server.py)
        case.validate_response(resp, excluded_checks=[positive_data_acceptance])

    check()
    assert len({path for path, _ in statuses}) >= 3, statuses  # the strategy reaches the routes
    if mode == "positive":
        assert sum(n for (_, status), n in statuses.items() if status == 200) > examples // 4, statuses
