"""Request parsing on its own (no engine): limits, defaults and the mapping onto SamplingParams."""
from __future__ import annotations

import pytest

from octavo.serving.api_error import ApiError
from octavo.serving.protocol import Limits, check_model, parse_chat, parse_completion
from octavo.serving.responses import completion_logprobs
from octavo.runtime.outputs import Logprob

LIM = Limits(vocab_size=100)


def test_defaults_and_vllm_extras_map_to_sampling_params() -> None:
    r = parse_completion({"prompt": "hi"}, LIM)
    assert r.params.max_tokens == 16 and r.params.temperature == 1.0 and r.params.n == 1 and not r.stream
    r = parse_completion({"prompt": [[1, 2], [3]], "max_tokens": 5, "temperature": 0, "top_k": -1, "min_p": 0.1,
                          "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2, "stop": "x",
                          "logit_bias": {"7": -100}, "seed": -1, "logprobs": 0, "n": 3, "best_of": 3}, LIM)
    p = r.params
    assert r.prompts == [[1, 2], [3]] and p.top_k == 0 and p.min_p == 0.1 and p.repetition_penalty == 1.2
    assert p.ignore_eos and p.min_tokens == 2 and p.stop == ["x"] and p.logit_bias == {7: -100.0}
    assert p.seed == 2**64 - 1 and p.logprobs == 0 and p.n == 3
    c = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, LIM)
    assert c.params.max_tokens is None  # chat: until the context is full
    c = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 3,
                    "logprobs": True, "top_logprobs": 4, "stream": True, "stream_options": {"include_usage": True}}, LIM)
    assert c.params.max_tokens == 3 and c.params.logprobs == 4 and c.include_usage


def test_max_tokens_cap() -> None:
    lim = Limits(vocab_size=100, max_tokens_cap=32)
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}]}, lim).params.max_tokens == 32
    assert parse_completion({"prompt": "x", "max_tokens": 32}, lim).params.max_tokens == 32
    with pytest.raises(ApiError, match="cap of 32") as e:
        parse_completion({"prompt": "x", "max_tokens": 33}, lim)
    assert e.value.status == 400 and e.value.param == "max_tokens"


@pytest.mark.parametrize("body", [
    {"prompt": "x", "best_of": 2}, {"prompt": "x", "suffix": "y"}, {"prompt": []}, {"prompt": [True]},
    {"prompt": "x", "stop_token_ids": [100]}, {"prompt": "x", "min_tokens": 20}, {"prompt": "x", "top_k": -2},
    {"prompt": "x", "presence_penalty": 3}, {"prompt": ["a"] * 65}, {"prompt": "x", "n": 17},
    {"prompt": ["a"] * 64, "n": 5},
])
def test_rejected(body: dict) -> None:
    with pytest.raises(ApiError) as e:
        parse_completion(body, LIM)
    assert e.value.status == 400 and e.value.body()["error"]["message"]


def test_chat_rejects_tools_and_non_text_parts() -> None:
    for body in ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
                 {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}):
        with pytest.raises(ApiError):
            parse_chat(body, LIM)
    with pytest.raises(ApiError) as e:
        check_model("other", ("tiny",))
    assert e.value.status == 404
    check_model(None, ("tiny",))


def test_completion_logprobs_shape() -> None:
    entries = [{5: Logprob(5, -0.1, "a"), 6: Logprob(6, -2.5, "bb"), 7: Logprob(7, -3.0, "c")},
               {8: Logprob(8, -float("inf"), "d"), 9: Logprob(9, -0.5, "e")}]
    lp = completion_logprobs(entries, [5, 8], 1, lambda t: "?")
    assert lp["tokens"] == ["a", "d"] and lp["text_offset"] == [0, 1]
    assert lp["token_logprobs"] == [-0.1, -9999.0]  # -inf is not JSON: clamped
    assert lp["top_logprobs"] == [{"a": -0.1}, {"e": -0.5, "d": -9999.0}]  # top-1 plus the chosen token
