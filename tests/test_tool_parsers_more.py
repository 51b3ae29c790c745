"""Tool-call parsers mistral, pythonic and qwen3_coder (vLLM's names): each format's text -> content + calls as
vLLM's parsers read it, whole and streamed at every split (the stream adds up to the whole); text that only
looks like calls stays content; then the official `openai` client against a server per parser whose scripted
model writes the format (auto: calls whole and as deltas), and tool_choice "required" / named keeping their
grammar guarantee under each parser (Mistral's 9-character call ids included).
"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from test_reasoning import Scripted, _streamed
from scripted_backend import ScriptedBackend
from toy_backend import make_toy_model_dir

from octavo.commands import serve as serve_command
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.background import ServerThread
from octavo.serving.server import OpenAIServer
from octavo.serving.state import ServerConfig
from octavo.serving.tool_parser_registry import TOOL_CALL_PARSERS, get_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "hot": {"type": "boolean"}, "tags": {"type": "array"}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
TWO = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]

# (parser, text, content, calls) as vLLM's parser of that name reads the text
CASES = [
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Sure.", TWO),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', None, TWO),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', None, TWO[:1]),
    ("mistral", "No call [TOOL", "No call [TOOL", []),
    ("mistral", "[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    ("pythonic", '[get_weather(city="Paris"), add(a=1, b=2)]', None, TWO),
    ("pythonic", "<|python_start|>[get_weather(city='Pa,ri]s'), add(a=1, b=2)]<|python_end|>", None,
     [("get_weather", {"city": "Pa,ri]s"}), TWO[1]]),
    ("pythonic", '[add(a=true, b=[1, {"x": null}])]', None, [("add", {"a": True, "b": [1, {"x": None}]})]),
    ("pythonic", "[Note] this is prose.", "[Note] this is prose.", []),
    ("pythonic", "The answer is 3.", "The answer is 3.", []),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=hot>\ntrue\n</parameter>\n<parameter=tags>\n"
                    '["a", "b"]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n'
                    "<parameter=a>\n1.5\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
     "Let me check.\n", [("get_weather", {"city": "Paris", "days": 3, "hot": True, "tags": ["a", "b"]}),
                         ("add", {"a": 1.5, "b": 2})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n</function>",
     None, [("get_weather", {"city": "123"})]),  # a string parameter stays text; an unclosed block at the end
    ("qwen3_coder", "Just text <tool", "Just text <tool", []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_and_streamed_at_every_split(name: str, text: str, content: str | None, calls: list) -> None:
    p = get_parser(name, TOOLS).parse(text)
    assert p.content == content
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == calls
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            st = get_parser(name, TOOLS).streamer()
            got, got_calls = "", []
            for piece in pieces:
                d = st.feed(piece)
                got, got_calls = got + d.content, got_calls + d.calls
            d = st.finish()
            got, got_calls = got + d.content, got_calls + d.calls
            assert (got if got.strip() or not got_calls else "") == (content or ""), cut
            assert [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in p.calls], cut
    if name == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in p.calls)


def test_serve_offers_every_parser() -> None:
    import argparse

    p = argparse.ArgumentParser()
    serve_command.add_arguments(p)
    action = next(a for a in p._actions if a.dest == "tool_call_parser")
    assert set(action.choices) == set(TOOL_CALL_PARSERS)


# ------------------------------------------------------------------------------------------------
# through a server

MSGS = [{"role": "user", "content": "Weather in Paris, and 1 + 2?"}]
SCRIPTS = {"mistral": CASES[1][1], "pythonic": CASES[5][1], "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                          "</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2"
                          "\n</parameter>\n</function>\n</tool_call>")}


@pytest.fixture(scope="module", params=["mistral", "pythonic", "qwen3_coder"])
def served(request, tmp_path_factory):  # noqa: ANN001, ANN201
    folder = make_toy_model_dir(tmp_path_factory.mktemp("tools"))
    backend = ScriptedBackend(256, 16, 384)
    ea = EngineArgs(model=str(folder), block_size=16, num_blocks=256, max_num_seqs=16)
    srv = OpenAIServer(ServerConfig(served_model_names=("m",), tool_call_parser=request.param),
                       lambda: AsyncEngine(ea, backend), shutdown_timeout=5)
    with ServerThread(srv) as t:
        yield request.param, Scripted(t, backend)


def test_auto_calls_whole_and_streamed(served) -> None:  # noqa: ANN001
    name, s = served
    s.say(MSGS, SCRIPTS[name])
    kw = dict(model="m", messages=MSGS, tools=TOOLS, max_tokens=400, temperature=0)
    r = s.client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == TWO
    st = _streamed(s.client, **kw)
    assert st["finish_reason"] == "tool_calls" and st["content"] == ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(st["tool_calls"].items())] == TWO
    # tool_choice "none": the same text is content
    r = s.client.chat.completions.create(**kw, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
DIGITS = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in "ab"},
          "required": ["a", "b"], "additionalProperties": False}
CLOSED = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
          {"type": "function", "function": {"name": "add", "parameters": DIGITS}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_calls_keep_their_grammar(served, choice) -> None:  # noqa: ANN001
    name, s = served
    s.backend.anchor = []  # the random model, constrained (closed schemas: a random model never closes an open one)
    kw = dict(model="m", messages=MSGS, tools=CLOSED, tool_choice=choice, n=8, temperature=1.0, max_tokens=150, seed=1,
              parallel_tool_calls=False)
    r = s.client.chat.completions.create(**kw)
    done = [c for c in r.choices if c.finish_reason != "length"]
    assert len(done) >= 4
    for c in done:
        assert c.finish_reason == "tool_calls"
        for t in c.message.tool_calls:
            schema = {"get_weather": CITY, "add": DIGITS}[t.function.name]
            jsonschema.validate(json.loads(t.function.arguments), schema)
            assert re.fullmatch(r"[A-Za-z0-9]{9}", t.id) if name == "mistral" else t.id.startswith("call_")
    if isinstance(choice, dict):
        assert all(t.function.name == "add" for c in done for t in c.message.tool_calls)


def test_openai_client_reads_the_calls_back_into_history(served) -> None:  # noqa: ANN001
    """A call's id and arguments go back as the next turn's history (the template gets the arguments as an object)."""
    name, s = served
    s.say(MSGS, SCRIPTS[name])
    r = s.client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=400, temperature=0)
    calls = r.choices[0].message.tool_calls
    history = MSGS + [r.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls]
    r2 = s.client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4, tool_choice="none")
    assert r2.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        s.client.chat.completions.create(model="m", messages=MSGS, tools=[{"type": "function"}], max_tokens=4)
