"""Fuzzing the HTTP server: no request, however malformed, gets a 500 or takes the server down.

Two fuzzers, both against a real server (tiny random model, real engine, loopback):
- schemathesis over our OpenAPI document (octavo/serving/openapi.py, served at /openapi.json):
  positive cases must succeed and match the documented response schemas; negative cases (schema
  violations) must be refused with a documented 4xx, never a 500.
- hypothesis over raw bytes and JSON the schema cannot express: invalid UTF-8, NaN/Infinity
  literals, integers with more digits than Python parses, nesting deeper than the recursion limit,
  huge strings, wrong methods and content types, junk Authorization headers, on every route.
Afterwards nothing runs and no KV block is held.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest
from engine_helpers import exported
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.state import ServerConfig
from octavo.serving.background import ServerThread
from octavo.serving.openapi import OPENAPI_PATH, add_openapi_route, openapi_schema, server_schema
from octavo.serving.server import OpenAIServer

KEY = "sk-fuzz"
NAME = "tiny"
CAP = 8  # --max-tokens-cap: keeps every valid request short
BODY_LIMIT = 64 << 10
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/chat/completions/batch"),
          ("GET", "/v1/models"),
          ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", OPENAPI_PATH),
          ("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
          ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")]
ERROR_KEYS = {"message", "type", "param", "code"}


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(hf_model_dir):  # noqa: ANN001, ANN201
    folder = exported(hf_model_dir("llama"))
    ea = EngineArgs(model=str(folder), num_blocks=128, block_size=16, max_num_seqs=16, num_threads=1)
    srv = OpenAIServer(ServerConfig(served_model_names=(NAME,), api_key=KEY, max_body_bytes=BODY_LIMIT,
                                    max_tokens_cap=CAP), lambda: AsyncEngine(ea), shutdown_timeout=5)
    if not any(getattr(r, "canonical", None) == OPENAPI_PATH for r in srv.app.router.resources()):
        add_openapi_route(srv.app, lambda: server_schema(srv.state))  # until app.py serves it itself
    with ServerThread(srv) as s:
        yield s


def metrics_idle(server, timeout: float = 15.0) -> dict[str, float]:  # noqa: ANN001
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.base_url + "/metrics", headers=auth()).text
        m = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels
             or set(s.labels) == {"model_name"}}
        if (m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
                and m["octavo:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_not_500(r: httpx.Response, what: object) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500], str(what)[:300])
    if r.status_code >= 400:
        body = r.json()
        keys = {"type", "message"} if body.get("type") == "error" else ERROR_KEYS  # Anthropic's shape: /v1/messages
        assert set(body["error"]) == keys, r.text[:300]


# ------------------------------------------------------------------------------------------------
# the document itself


def test_openapi_document_is_served_behind_the_key(server) -> None:  # noqa: ANN001
    assert httpx.get(server.base_url + OPENAPI_PATH).status_code == 401
    doc = httpx.get(server.base_url + OPENAPI_PATH, headers=auth()).json()
    assert doc == openapi_schema((NAME,), max_tokens_cap=CAP, vocab_size=384, version=doc["info"]["version"])
    assert {p for p in doc["paths"]} == {path for _, path in ROUTES}
    assert doc["paths"]["/health"]["get"]["security"] == []  # the one route without the key
    req = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert req["max_tokens"]["maximum"] == CAP and req["n"]["maximum"] == 16


# ------------------------------------------------------------------------------------------------
# schemathesis


def _schemathesis_schema(server):  # noqa: ANN001, ANN202
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis not installed (pip install schemathesis)")
    doc = httpx.get(server.base_url + OPENAPI_PATH, headers=auth()).json()
    return schemathesis, schemathesis.openapi.from_dict(doc)


@pytest.mark.parametrize("mode, examples", [
    ("positive", 60), ("negative", 80),
    pytest.param("positive", 1000, marks=pytest.mark.slow), pytest.param("negative", 1500, marks=pytest.mark.slow)])
def test_schemathesis_against_the_openapi_document(server, mode: str, examples: int) -> None:  # noqa: ANN001
    """Positive: valid requests get 200 with bodies matching the documented schemas. Negative: requests
    violating the schema get a documented 4xx in the error shape. Never a 500, in either mode."""
    schemathesis, schema = _schemathesis_schema(server)
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    strategy = schema.as_strategy(GenerationMode(mode), headers=auth())
    statuses: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case) -> None:  # noqa: ANN001
        if case.headers is None or "Authorization" not in case.headers:
            case.headers = {**(case.headers or {}), **auth()}
        resp = case.call(base_url=server.base_url, timeout=30)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (resp.status_code, resp.text[:400], case.path, case.body)
        # positive: schema-valid requests can still be refused for what a schema cannot say (a prompt
        # that tokenizes to nothing or is too long, min_tokens > max_tokens, top_logprobs without
        # logprobs): those are 400s naming the problem, so acceptance is not required, conformance is
        excluded = [positive_data_acceptance] if mode == "positive" else []
        case.validate_response(resp, excluded_checks=excluded)

    check()
    assert statuses, "no case ran"
    if mode == "positive":
        assert statuses.get(200, 0) > examples // 4, statuses  # the valid cases really reached the engine
    else:
        assert statuses.get(400, 0) > 0, statuses
    assert metrics_idle(server)["octavo:kv_cache_usage_perc"] == 0


# ------------------------------------------------------------------------------------------------
# raw bytes: what JSON schemas cannot say

HOSTILE_BODIES = [
    b"", b"null", b"[]", b'"prompt"', b"{", b"{}", b'{"prompt": }',
    b"\xff\xfe\x00garbage", b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xed\xa0\x80"}',  # invalid UTF-8, surrogate
    b'{"prompt": "\\ud800"}',  # a lone surrogate escape: valid JSON, not encodable text
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
    b'{"prompt": "x", "max_tokens": -Infinity}', b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",  # more digits than int() accepts (ValueError, not JSONDecodeError)
    b'{"prompt": ' + b"1" * 4400 + b"}",
    b"[" * 200_00 + b"]" * 200_00,  # deeper than the recursion limit (RecursionError)
    b'{"prompt": ' + b'{"a":' * 5000 + b"1" + b"}" * 5001,
    b'{"prompt": [' + b"1," * 5000 + b"1]}",  # long, valid token list
    b'{"prompt": "x", "max_tokens": 99999999999999999999999999}',
    b'{"prompt": "x", "n": 1e308}', b'{"prompt": "x", "logit_bias": {"\xd9\xa3": 1}}',
    b'{"prompt": "x", "logit_bias": {"1e3": 1, "-0": 2}}', b'{"prompt": "x", "stop": ["' + b"a" * 60000 + b'"]}',
    b'{"prompt": "x", "stop_token_ids": [1e999]}', b'{"prompt": [[1, 2], "x"]}', b'{"prompt": [true, false]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}]}',
    b'{"messages": [{"role": {"$ne": 1}, "content": "x"}]}', b'{"messages": "x"}',
    b'{"prompt": "x", "stream": "true"}', b'{"prompt": "x", "stream": true, "stream_options": []}',
    b'{"prompt": "x", "model": ["tiny"]}', b'{"prompt": "x", "model": "../../../../etc/passwd"}',
    b'{"prompt": "x", "__proto__": {"admin": true}, "constructor": null}',
    b'{"prompt": "x", "prompt": 7}',  # duplicate keys: the last wins
    b"\x00" * 1000, b'{"prompt": "' + b"x" * (BODY_LIMIT + 10) + b'"}',  # over the body cap: 413
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
                                  "/tokenize", "/detokenize"])
def test_hostile_bodies_are_4xx(server, path: str) -> None:  # noqa: ANN001
    with httpx.Client(timeout=60) as http:
        for body in HOSTILE_BODIES:
            r = http.post(server.base_url + path, content=body, headers={**auth(), "Content-Type": "application/json"})
            assert_not_500(r, body[:80])
        r = http.post(server.base_url + path, content=b'{"prompt": "' + b"x" * (BODY_LIMIT + 10) + b'"}', headers=auth())
        assert r.status_code == 413
        # a body streamed without Content-Length, over the limit: still 413, not a 500 or a hang
        r = http.post(server.base_url + path, content=iter([b'{"prompt": "', b"x" * BODY_LIMIT, b'"}']), headers=auth())
        assert r.status_code == 413
        assert http.get(server.base_url + "/health").status_code == 200
    assert metrics_idle(server)["octavo:kv_cache_usage_perc"] == 0


_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from([NAME, "user", "text", "", "\x00", "\ud7ff", 2**64, -(2**63) - 1, 1e308, 5e-324]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["prompt", "messages", "role", "content", "type", "text", "max_tokens", "n", "stop",
                         "logit_bias", "stream", "stream_options", "include_usage", "logprobs", "seed", "1"]),
        inner, max_size=4),
    max_leaves=12)


def _encode(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


_RAW_ARGS = dict(
    route=st.sampled_from(ROUTES), method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]),
    body=st.one_of(_junk.map(_encode), st.binary(max_size=200),
                   st.builds(lambda v, cut: _encode(v)[:cut], _junk, st.integers(0, 50))),
    header=st.sampled_from([None, f"Bearer {KEY}", f"bearer  {KEY}", "Bearer", f"Basic {KEY}", "Bearer \u00e9\u00e9",
                            f"Bearer {KEY}\u00e9", "x" * 2000]),
    content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x",
                                  "application/x-www-form-urlencoded", "application/json; charset=latin-1"]),
    query=st.sampled_from(["", "?model=../../etc/passwd", "?stream=true&x=%ff%fe", "?" + "a=1&" * 200]))


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(**_RAW_ARGS)
def test_raw_fuzz_every_route(server, **kw) -> None:  # noqa: ANN001
    raw_check(server, **kw)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(**_RAW_ARGS)
def test_slow_raw_fuzz_every_route(server, **kw) -> None:  # noqa: ANN001
    raw_check(server, **kw)


def raw_check(server, route, method, body, header, content_type, query) -> None:  # noqa: ANN001
    """Random bytes and random JSON to every route with any method, content type, query and key header:
    always a well-formed answer below 500; the right key is needed everywhere but /health."""
    headers: dict[str, str | bytes] = {"Content-Type": content_type}
    if header is not None:
        headers["Authorization"] = header.encode("utf-8")  # raw UTF-8 bytes on the wire
    if isinstance(body, dict | list):
        body = _encode(body)
    url = server.base_url + route[1] + query
    with httpx.Client(timeout=60) as http:
        r = http.request(method, url, content=body if method not in ("GET", "HEAD") else None, headers=headers)
    if method == "HEAD":
        assert r.status_code < 500
        return
    assert_not_500(r, (method, route, body[:80]))
    authorised = header is not None and header.strip() in (f"Bearer {KEY}", f"bearer  {KEY}")
    if route[1] != "/health" and not authorised:
        assert r.status_code in (401, 404, 405), (r.status_code, header, route)


def test_server_survives_and_is_idle_after_fuzzing(server) -> None:  # noqa: ANN001
    r = httpx.post(server.base_url + "/v1/completions", headers=auth(),
                   json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    m = metrics_idle(server)
    assert m["octavo:num_requests_running"] == 0 and m["octavo:kv_cache_usage_perc"] == 0
