"""Structured outputs and tool calling on the embedded SmolLM2-135M-Instruct (a real model: its JSON is
its own, whitespace included), with the official `openai` client against octavo's server: a pydantic
`parse`; 50 sampled (temperature 1.0) outputs per constraint that validate (jsonschema, re.fullmatch,
membership, Lark's parser) unless cut by max_tokens; tool_choice required / named calls that validate,
streamed and not. Slow (a 135M model on CPU): `pytest -m slow tests/test_structured_smollm2.py`.
"""
from __future__ import annotations

import enum
import json
import re
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serve_process import serve_in_thread

from octavo.runtime.engine_args import EngineArgs

pytestmark = pytest.mark.slow
NAME = "smollm2"
N = 50


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favourite_color: Color
    hobbies: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)
    address: Address


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "color", "hobbies"], "additionalProperties": False}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ARITH = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,4}/\n'
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    from octavo.export.embedded import default_model_path
    from octavo.export.resolve import resolve_model

    model = resolve_model(default_model_path())
    ea = EngineArgs(model=str(model), max_num_seqs=64, block_size=16)
    with serve_in_thread(ea, served_model_names=(NAME,), max_n=N, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_pydantic_parse(client) -> None:  # noqa: ANN001
    r = client.chat.completions.parse(model=NAME, messages=ask("Invent a person and describe them as JSON."),
                                      response_format=Person, max_tokens=160, temperature=0.7, seed=1)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and isinstance(p.address, Address) and isinstance(p.favourite_color, Color)


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_fifty_sampled_outputs_validate(client, kind: str) -> None:  # noqa: ANN001
    prompt, extra, max_tokens = {
        "json": ("Describe a person as JSON.", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}}}, 96),
        "regex": ("Write a US phone number.", {"extra_body": {"structured_outputs": {"regex": PHONE}}}, 24),
        "choice": ("Is the sky blue? Answer yes, no or maybe.",
                   {"extra_body": {"guided_choice": ["yes", "no", "maybe"]}}, 8),
        "grammar": ("Write a sum of a few numbers.", {"extra_body": {"structured_outputs": {"grammar": ARITH}}}, 24),
    }[kind]
    r = client.chat.completions.create(model=NAME, messages=ask(prompt), n=N, temperature=1.0, max_tokens=max_tokens,
                                       seed=7, **extra)
    assert len(r.choices) == N
    for c in r.choices:
        text = c.message.content
        if c.finish_reason == "length":
            assert kind != "grammar" or arith_prefix_ok(text), text
            continue
        assert c.finish_reason == "stop"
        if kind == "json":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(PHONE, text)
        elif kind == "choice":
            assert text in ("yes", "no", "maybe")
        else:
            lark_parser_arith().parse(text)
    assert sum(c.finish_reason == "stop" for c in r.choices) >= (N // 2 if kind != "grammar" else 1)


def lark_parser_arith():  # noqa: ANN201
    import lark

    return lark.Lark(ARITH, parser="lalr")


def arith_prefix_ok(text: str) -> bool:
    from test_structured import prefix_ok

    return prefix_ok(lark_parser_arith(), text)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_fifty_sampled_tool_calls_validate(client, choice, stream: bool) -> None:  # noqa: ANN001
    kw = dict(model=NAME, messages=ask("What is the weather like in Paris?"), tools=TOOLS, tool_choice=choice, n=N,
              temperature=1.0, max_tokens=64, seed=3)
    if not stream:
        got = [(c.message.tool_calls or [], c.finish_reason) for c in client.chat.completions.create(**kw).choices]
    else:
        acc: dict[int, dict[int, dict]] = {}
        reasons: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    e = acc.setdefault(ch.index, {}).setdefault(d.index, {"name": "", "arguments": ""})
                    e["name"] += (d.function.name or "") if d.function else ""
                    e["arguments"] += (d.function.arguments or "") if d.function else ""
                if ch.finish_reason:
                    reasons[ch.index] = ch.finish_reason
        got = [([openai.types.chat.ChatCompletionMessageFunctionToolCall(id="x", type="function", function=e)
                 for _, e in sorted(acc.get(i, {}).items())], reasons[i]) for i in sorted(reasons)]
    assert len(got) == N
    assert sum(reason == "tool_calls" for _, reason in got) >= N // 2
    for calls, reason in got:
        if reason == "length":
            continue
        assert reason == "tool_calls" and calls
        for c in calls:
            assert c.function.name == "get_weather"
            jsonschema.validate(json.loads(c.function.arguments), WEATHER)


def test_auto_with_hermes_parser(client) -> None:  # noqa: ANN001
    """A prompt that makes the model write the Hermes format itself comes back as tool_calls."""
    msgs = [{"role": "system", "content": 'Reply with exactly this and nothing else: <tool_call>{"name": "get_weather", '
                                          '"arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'},
            {"role": "user", "content": "Weather in Paris?"}]
    grammar = ('start: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps({
        "type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
        "required": ["name", "arguments"], "additionalProperties": False}) + "\n")
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, max_tokens=64, temperature=0.0,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER)
