"""Tool calling on /v1/chat/completions: the Hermes and Llama-3 JSON parsers (whole and streamed, split at
every point), the request side (tools, tool_choice, parallel_tool_calls, tool-call history), tools reaching
the chat template exactly as transformers' apply_chat_template(tools=...) renders them, and, against a
server on a tiny random model with the official `openai` client: 50 sampled `required` and named calls
that parse and validate against the function's schema, streamed and not; `auto` with the Hermes parser
returning tool_calls.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from engine_helpers import exported
from test_structured_server import server  # noqa: F401 - the fixture

from octavo.serving.api_error import ApiError
from octavo.serving.protocol import Limits, parse_chat
from octavo.serving.tool_parsers import HermesParser, Llama3JsonParser

NAME = "tiny"
N = 50
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
LIM = Limits(vocab_size=1000, tool_call_parser="hermes")


# ------------------------------------------------------------------------------------------------
# parsers


HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
LLAMA_TEXT = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'


@pytest.mark.parametrize("parser, text, content", [
    (HermesParser(), HERMES_TEXT, "Let me look.\n"),
    (Llama3JsonParser(), LLAMA_TEXT, None),
])
def test_parsers_whole_and_streamed_at_every_split(parser, text: str, content: str | None) -> None:  # noqa: ANN001
    p = parser.parse(text)
    assert p.content == content
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in p.calls}) == 2 and all(c.id.startswith("call_") for c in p.calls)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            st = parser.streamer()
            got_content, calls = "", []
            for piece in pieces:
                d = st.feed(piece)
                got_content += d.content
                calls += d.calls
            d = st.finish()
            got_content += d.content
            calls += d.calls
            assert (got_content or None) == (content or None), cut
            assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in p.calls], cut


def test_parsers_leave_plain_or_malformed_text_as_content() -> None:
    for parser in (HermesParser(), Llama3JsonParser()):
        for text in ("The weather is fine.", "<tool_call>{not json}</tool_call>", '{"no_name": 1}', "{"):
            p = parser.parse(text)
            assert p.content == text and not p.calls
            st = parser.streamer()
            d1, d2 = st.feed(text), st.finish()
            assert d1.content + d2.content == text and not d1.calls + d2.calls
    p = HermesParser().parse('<tool_call>{"name": "add", "arguments": {"a": 1}}')  # unclosed at the end: a call
    assert p.calls and p.calls[0].name == "add"


# ------------------------------------------------------------------------------------------------
# the request


def test_tool_request_parsing() -> None:
    r = parse_chat({"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, LIM)
    assert r.tool_choice.mode == "required" and not r.parallel_tool_calls
    schema = r.params.structured_outputs.json
    assert schema["type"] == "array" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    r = parse_chat({"messages": MSGS, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
                   LIM)
    assert r.tool_choice.name == "add" and r.params.structured_outputs.json == ADD
    r = parse_chat({"messages": MSGS, "tools": TOOLS}, LIM)
    assert r.tool_choice.mode == "auto" and r.params.structured_outputs is None
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = parse_chat({"messages": history, "tools": TOOLS, "tool_choice": "none"}, LIM)
    assert r.messages[1]["tool_calls"][0]["function"]["name"] == "add" and r.messages[2]["tool_call_id"] == "call_1"


@pytest.mark.parametrize("body, limits", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, LIM),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, LIM),
    ({"tools": TOOLS + TOOLS[:1]}, LIM),  # a name twice
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, LIM),
    ({"tool_choice": "required"}, LIM),  # no tools
    ({"tools": TOOLS, "tool_choice": "sometimes"}, LIM),
    ({"tools": TOOLS}, Limits(vocab_size=1000)),  # auto without a parser
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, LIM),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, LIM),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, LIM),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}, LIM),
])
# (a tool whose parameter schema does not compile is refused by the server, which compiles it on the engine's
# grammar workers: test_structured_server.py::test_bad_constraints_are_400_naming_the_field)
def test_bad_tool_requests_are_400(body: dict, limits: Limits) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": MSGS, **body}, limits)
    assert e.value.status == 400 and e.value.body()["error"]["param"]


def test_tools_reach_the_template_as_transformers_renders_them(hf_model_dir) -> None:  # noqa: ANN001
    import transformers

    from octavo.export.manifest import Manifest
    from octavo.runtime.tokenizer import Tokenizer
    from octavo.serving.tools import template_messages

    folder = exported(hf_model_dir("llama"))
    tok = Tokenizer(folder, Manifest.load(folder))
    tok.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    history = parse_chat({"messages": MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}], "tools": TOOLS, "tool_choice": "none"}, LIM)
    ours = tok.apply_chat_template(template_messages(history.messages), True, tools=history.tools)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    hf_msgs = [dict(m) for m in template_messages(history.messages)]
    want = hf.apply_chat_template(hf_msgs, tools=history.tools, chat_template=tok.chat_template, tokenize=False,
                                  add_generation_prompt=True)
    assert ours == want and '"name": "get_weather"' in ours and '<call>add {"a": 1, "b": 2}</call>' in ours
    ids = tok.encode_chat(template_messages(history.messages), tools=history.tools)
    assert tok.decode(ids, skip_special_tokens=False) == ours


# ------------------------------------------------------------------------------------------------
# the server


# the same module-scoped server as the structured-output tests (hermes tool-call parser)


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _valid(calls: list, allowed: set[str]) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed_calls(client, **kw: object) -> list[tuple[list, str]]:  # noqa: ANN001
    """Per choice: the tool calls assembled from the deltas, as the openai client's users do, and the finish reason."""
    acc: dict[int, dict[int, dict]] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                e = acc.setdefault(ch.index, {}).setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                e["id"] = d.id or e["id"]
                if d.function is not None:
                    e["name"] += d.function.name or ""
                    e["arguments"] += d.function.arguments or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    out = []
    for i in sorted(reasons):
        calls = [openai.types.chat.ChatCompletionMessageFunctionToolCall(
            id=e["id"], type="function", function={"name": e["name"], "arguments": e["arguments"]})
            for _, e in sorted(acc.get(i, {}).items())]
        out.append((calls, reasons[i]))
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_fifty_sampled_forced_calls_validate(client, choice, stream: bool) -> None:  # noqa: ANN001
    kw = dict(model=NAME, messages=MSGS, tools=TOOLS, tool_choice=choice, n=N, temperature=1.0, max_tokens=64, seed=2)
    allowed = {"add"} if isinstance(choice, dict) else set(SCHEMAS)
    if stream:
        got = _streamed_calls(client, **kw)
    else:
        r = client.chat.completions.create(**kw)
        got = [(c.message.tool_calls or [], c.finish_reason) for c in r.choices]
        assert all(c.message.content is None for c in r.choices if c.finish_reason == "tool_calls")
    assert len(got) == N
    done = [calls for calls, reason in got if reason != "length"]
    assert len(done) >= N // 2
    for calls, reason in got:
        if reason != "length":
            assert reason == "tool_calls"
            _valid(calls, allowed)
    if not isinstance(choice, dict):
        r = client.chat.completions.create(**{**kw, "n": 8}, parallel_tool_calls=False)
        assert all(len(c.message.tool_calls) == 1 for c in r.choices if c.finish_reason == "tool_calls")


HERMES_GRAMMAR = ('start: "<tool_call>" call "</tool_call>"\n'
                  'call: %json {"x-guidance": {"whitespace_flexible": false}, "type": "object", "properties": '
                  '{"name": {"const": "add"}, "arguments": ' + json.dumps(ADD) + '}, '
                  '"required": ["name", "arguments"], "additionalProperties": false}\n')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_hermes_parser_returns_tool_calls(client, stream: bool) -> None:  # noqa: ANN001
    # a random model plus a grammar that makes it write Hermes calls (what a tool-trained model does itself)
    kw = dict(model=NAME, messages=MSGS, tools=TOOLS, n=8, temperature=1.0, max_tokens=64, seed=4,
              extra_body={"structured_outputs": {"grammar": HERMES_GRAMMAR}})
    if stream:
        got = _streamed_calls(client, **kw)
    else:
        r = client.chat.completions.create(**kw)
        got = [(c.message.tool_calls or [], c.finish_reason) for c in r.choices]
    assert sum(reason == "tool_calls" for _, reason in got) >= 4
    for calls, reason in got:
        if reason == "tool_calls":
            _valid(calls, {"add"})
    # tool_choice "none": the same text stays content
    r = client.chat.completions.create(**{**kw, "n": 2}, tool_choice="none")
    assert all(c.message.tool_calls is None and c.message.content.startswith("<tool_call>") for c in r.choices)


def test_tool_history_is_accepted(server) -> None:  # noqa: ANN001
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4})
    assert r.status_code == 200, r.text
