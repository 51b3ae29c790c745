"""POST /v1/responses through the official openai client (`client.responses.create`, whole and streamed, and the
SDK's `responses.stream` helper, which checks the event sequence as it accumulates it), against the chat
completions route on the same server (greedy: the same conversation gives the same tokens)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from engine_helpers import exported
from serve_process import serve_in_thread

from octavo.runtime.engine_args import EngineArgs

KEY = "sk-resp"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(hf_model_dir):  # noqa: ANN001, ANN201
    args = EngineArgs(model=str(exported(hf_model_dir("llama"))), num_blocks=128, block_size=16, num_threads=1)
    with serve_in_thread(args, served_model_names=("tiny",), api_key=KEY) as s:
        yield s


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def chat_reference(client, max_tokens: int, messages: list[dict]) -> tuple[str, str, int]:  # noqa: ANN001
    c = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return c.choices[0].message.content, c.choices[0].finish_reason, c.usage.prompt_tokens


def test_whole_response_matches_chat(client) -> None:  # noqa: ANN001
    r = client.responses.create(model="tiny", instructions="Answer briefly.", input="What is the capital of France?",
                                max_output_tokens=12, temperature=0)
    text, reason, prompt_tokens = chat_reference(client, 12, [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.status == ("incomplete" if reason == "length" else "completed")
    if reason == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == prompt_tokens and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.store is False


def test_streamed_response_events(client) -> None:  # noqa: ANN001
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."},
                    {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}]
    events = list(client.responses.create(model="tiny", input=conversation, max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          events[-1].type] and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    text, _, _ = chat_reference(client, 10, [{"role": "user", "content": "Hello"},
                                             {"role": "assistant", "content": "Hi there."},
                                             {"role": "user", "content": "Tell me a story."}])
    assert deltas == text == events[-1].response.output_text
    # the SDK's stream helper accumulates the events (it fails on an inconsistent sequence); cut by
    # max_output_tokens the stream ends with response.incomplete, which get_final_response does not take
    with client.responses.stream(model="tiny", input=conversation, max_output_tokens=10, temperature=0) as stream:
        last = list(stream)[-1]
    assert last.response.output_text == text


@pytest.mark.parametrize("stream", [False, True])
def test_function_call(client, stream) -> None:  # noqa: ANN001
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
    kw = dict(model="tiny", input="Weather in Paris?", tools=tools, max_output_tokens=64, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        with client.responses.stream(**kw) as s:
            events = list(s)
        kinds, r = [e.type for e in events], events[-1].response
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # the call and its result go back as input items (stateless: the client sends the whole conversation)
    r2 = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, tools=tools, tool_choice="none",
                                 input=[{"role": "user", "content": "Weather in Paris?"},
                                        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                                         "arguments": calls[0].arguments},
                                        {"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "sunny"}])
    assert r2.output[0].type == "message"


def test_json_schema_format(client) -> None:  # noqa: ANN001
    r = client.responses.create(model="tiny", input="A city as JSON", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
])
def test_bad_requests_are_400(server, body, param) -> None:  # noqa: ANN001
    r = httpx.post(server.base_url + "/v1/responses", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auth_and_unknown_model(server, client) -> None:  # noqa: ANN001
    assert httpx.post(server.base_url + "/v1/responses", json={"input": "hi"}).status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi")
