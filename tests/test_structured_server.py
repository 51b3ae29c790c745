"""Structured outputs over HTTP, driven by the official `openai` client and raw httpx, on a tiny random model:
OpenAI's response_format (json_object, json_schema, a pydantic model through `parse`), vLLM's
structured_outputs and guided_* fields, on chat and completions; malformed constraints are 400s that name
the field; known-but-unimplemented fields are 400s; unknown fields are logged once; /openapi.json
describes the new fields. 50 sampled outputs per constraint validate (jsonschema, re.fullmatch,
membership, Lark's parser) unless cut by max_tokens.
"""
from __future__ import annotations

import enum
import json
import logging
from typing import Annotated

import httpx
import openai
import pytest
from engine_helpers import exported
from pydantic import BaseModel, Field
from serve_process import serve_in_thread
from test_structured import CHOICES, LARK, REGEX, SCHEMA, validate

from octavo.runtime.engine_args import EngineArgs

NAME = "tiny"
N = 50
MSGS = [{"role": "user", "content": "Give me JSON."}]


@pytest.fixture(scope="module")
def server(hf_model_dir):  # noqa: ANN001, ANN201
    ea = EngineArgs(model=str(exported(hf_model_dir("llama"))), num_blocks=512, block_size=16, max_num_seqs=64,
                    num_threads=1)
    with serve_in_thread(ea, served_model_names=(NAME,), max_n=N, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def ws_bias(server) -> dict[str, float]:  # noqa: ANN001
    """logit_bias -100 on whitespace-only tokens: JSON's free whitespace is a trap a random model falls into
    forever (a real model does not; see the SmolLM2 tests). Also shows the grammar mask comes first: a
    biased token the grammar allows is still possible, one it forbids never is."""
    tok = server.server.state.tokenizer
    return {str(t): -100.0 for t in range(tok.vocab_size) if (s := tok.decode([t])) and not s.strip()}


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


TIGHT = {"disable_any_whitespace": True}
# (route, body fields, kind): every way a constraint can be asked for
CASES = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
              "structured_outputs": None}, "json"),
    ("chat", {"response_format": {"type": "json_object"}}, "json_object"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}, "json"),
    ("chat", {"structured_outputs": {"json": SCHEMA, **TIGHT}}, "json"),
    ("completions", {"structured_outputs": {"regex": REGEX}}, "regex"),
    ("chat", {"structured_outputs": {"choice": CHOICES}}, "choice"),
    ("completions", {"structured_outputs": {"grammar": LARK}}, "grammar"),
    ("chat", {"guided_json": json.dumps(SCHEMA)}, "json"),
    ("chat", {"guided_regex": REGEX}, "regex"),
    ("completions", {"guided_choice": CHOICES}, "choice"),
    ("chat", {"guided_grammar": LARK, "guided_decoding_backend": "guidance"}, "grammar"),
]


@pytest.mark.parametrize("route, fields, kind", CASES, ids=[f"{r}-{next(iter(f))}-{k}" for r, f, k in CASES])
def test_fifty_sampled_outputs_validate(client, ws_bias, route: str, fields: dict, kind: str) -> None:  # noqa: ANN001
    extra = {k: v for k, v in fields.items() if v is not None and k != "response_format"}
    common = dict(model=NAME, n=N, temperature=1.0, max_tokens=96, seed=11, extra_body=extra, logit_bias=ws_bias)
    if route == "chat":
        r = client.chat.completions.create(messages=MSGS, response_format=fields.get("response_format", openai.NOT_GIVEN),
                                           **common)
        got = [(c.message.content, c.finish_reason) for c in r.choices]
    else:
        if "response_format" in fields:
            common["extra_body"] = {**extra, "response_format": fields["response_format"]}
        r = client.completions.create(prompt="Once upon a time", **common)
        got = [(c.text, c.finish_reason) for c in r.choices]
    assert len(got) == N
    for text, reason in got:
        validate(kind, text, reason)  # test_structured's check of each kind of constraint
    assert sum(reason == "stop" for _, reason in got) >= N // 5, got[:3]


class Kind(str, enum.Enum):
    cat = "cat"
    dog = "dog"


class Home(BaseModel):
    x: int = Field(ge=-9, le=9)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    kind: Kind
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=2)
    home: Home


def test_pydantic_parse_and_streaming(client, server, ws_bias) -> None:  # noqa: ANN001
    r = client.chat.completions.parse(model=NAME, messages=MSGS, response_format=Pet, max_tokens=200, seed=5,
                                      logit_bias=ws_bias)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.home, Home) and 0 <= pet.age <= 99
    # streamed: the same seeded text as the whole response
    body = {"model": NAME, "messages": MSGS, "max_tokens": 200, "seed": 5, "stream": True, "logit_bias": ws_bias,
            "response_format": {"type": "json_schema", "json_schema": {"name": "Pet", "schema": Pet.model_json_schema()}}}
    text = ""
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                text += "".join(c["delta"].get("content") or "" for c in ch["choices"])
    whole = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=200, seed=5, logit_bias=ws_bias,
                                           response_format=body["response_format"])
    assert text == whole.choices[0].message.content
    if whole.choices[0].finish_reason == "stop":
        Pet.model_validate_json(text)


@pytest.mark.parametrize("route, fields, param", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("chat", {"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs"),
    ("completions", {"guided_json": "{not json"}, "guided_json"),
    ("chat", {"guided_regex": "[a-"}, "guided_regex"),
    ("chat", {"guided_choice": []}, "guided_choice"),
    ("chat", {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("chat", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("chat", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("chat", {"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("chat", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # (not in a stream, as vLLM)
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
              "tool_choice": "required"}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
])
def test_bad_constraints_are_400_naming_the_field(server, route: str, fields: dict, param: str) -> None:  # noqa: ANN001
    base = {"messages": MSGS} if route == "chat" else {"prompt": "x"}
    r = httpx.post(f"{server.base_url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                   json={**base, **fields, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_defaults_of_unimplemented_fields_pass_and_unknown_fields_warn_once(server, caplog) -> None:  # noqa: ANN001
    body = {"messages": MSGS, "max_tokens": 2, "use_beam_search": False, "response_format": {"type": "text"},
            "frobnicate_level": 3}
    with caplog.at_level(logging.WARNING, logger="octavo.serving.protocol"):
        for _ in range(3):
            assert httpx.post(server.base_url + "/v1/chat/completions", json=body).status_code == 200
    assert sum("frobnicate_level" in r.getMessage() for r in caplog.records) == 1


def test_openapi_carries_the_constraint_and_tool_fields(server) -> None:  # noqa: ANN001
    spec = httpx.get(server.base_url + "/openapi.json").json()
    schemas = json.dumps(spec)
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "json_schema", "tool_choice", "parallel_tool_calls", "tool_calls", "tool_call_id"):
        assert f'"{name}"' in schemas, name
