"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` SDK, whole
and streamed, with tool use, against the chat completions route on the same server (greedy: the same
conversation gives the same tokens) and /tokenize for the counts."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from engine_helpers import exported
from serve_process import serve_in_thread

from octavo.runtime.engine_args import EngineArgs

KEY = "sk-anthropic"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more; the API still takes them
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def server(hf_model_dir):  # noqa: ANN001, ANN201
    args = EngineArgs(model=str(exported(hf_model_dir("llama"))), num_blocks=128, block_size=16, num_threads=1)
    with serve_in_thread(args, served_model_names=("tiny",), api_key=KEY) as s:
        yield s


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def chat(server, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:  # noqa: ANN001
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    return c.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_message_matches_chat(server, client) -> None:  # noqa: ANN001
    m = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, system="Be brief.",
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    ref = chat(server, [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is the capital of France?"}], max_tokens=12)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == "tiny"
    assert m.content[0].type == "text" and m.content[0].text == ref.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]
    assert m.usage.input_tokens == ref.usage.prompt_tokens and m.usage.output_tokens == ref.usage.completion_tokens


def test_stop_sequence(server, client) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Tell me a story."}]
    free = chat(server, messages, max_tokens=16).choices[0].message.content
    stop = next((free[i:i + 2] for i in range(2, len(free) - 2) if free[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the tiny model's text has no usable stop sequence")
    m = client.messages.create(model="tiny", max_tokens=16, extra_body=GREEDY, messages=messages, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == free[:free.index(stop)]


def test_streamed_message(server, client) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Tell me a story."}]
    with client.messages.stream(model="tiny", max_tokens=10, extra_body=GREEDY, messages=messages) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    ref = chat(server, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                        {"role": "user", "content": "Tell me a story."}], max_tokens=10)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == ref.choices[0].message.content
    assert final.usage.output_tokens == ref.usage.completion_tokens and final.usage.input_tokens == ref.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(client, stream) -> None:  # noqa: ANN001
    kw = dict(model="tiny", max_tokens=64, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        with client.messages.stream(**kw) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            m = s.get_final_message()
        assert "input_json_delta" in deltas
    else:
        m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    # the call and its result in the next turn
    m2 = client.messages.create(model="tiny", max_tokens=4, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "none"},
                                messages=[{"role": "user", "content": "Weather in Paris?"},
                                          {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id,
                                                                             "name": "get_weather", "input": uses[0].input}]},
                                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                                        "content": "sunny"}]}])
    assert m2.content[0].type == "text"


def test_count_tokens(server, client) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    n = client.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    r = httpx.post(server.base_url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "system", "content": "Be brief."}, *messages]})
    assert n.input_tokens == r.json()["count"] > 0


def test_errors_in_anthropic_shape(server, client) -> None:  # noqa: ANN001
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    {"max_tokens": 4, "messages": []},
    {"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 1024}},
])
def test_bad_requests_are_400(server, body) -> None:  # noqa: ANN001
    r = httpx.post(server.base_url + "/v1/messages", json={"model": "tiny", **body}, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
