"""Request parsing on its own (no engine): limits, defaults and the mapping onto SamplingParams."""
from __future__ import annotations

import re

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


def test_chat_rejects_malformed_tools_and_non_text_parts() -> None:
    for body in ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
                 {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}):
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


# ---- JSON bodies: strict UTF-8, no lone surrogates, and no re-serialising to find them -------------------

def test_lone_surrogates_are_400_valid_pairs_and_escaped_backslashes_pass() -> None:
    import json

    from octavo.serving.app import parse_json_body

    for raw in (b'{"prompt": "\\ud800"}', b'{"prompt": "ok \\uDFFF"}', b'{"prompt": "\\ud83d\\ude00\\ud83d"}',
                b'{"messages": [{"role": "user", "content": ["x", {"\\udc00": 1}]}]}', b'{"prompt": "\xed\xa0\x80"}'):
        with pytest.raises(ApiError) as err:
            parse_json_body(raw)
        assert err.value.status == 400 and "not valid JSON in UTF-8" in err.value.message, raw
    for value in ({"prompt": "emoji \U0001F600 and \u00e9"}, {"prompt": "\\ud800 is only text here"},
                  {"prompt": [1, 2, 3], "stop": ["\U0001F600"]}):
        for ascii_only in (True, False):  # Python clients send astral characters as escaped surrogate pairs
            assert parse_json_body(json.dumps(value, ensure_ascii=ascii_only).encode()) == value


def test_surrogate_check_agrees_with_the_decoded_strings() -> None:
    """Random JSON strings made of escapes that interact (escaped backslashes before "u", high and low halves,
    valid pairs, other escapes): the body is refused exactly when json.loads yields a surrogate code point."""
    import json
    import random

    from octavo.serving.app import parse_json_body

    pieces = ["\\\\", "\\ud83d", "\\uDE00", "\\udbff", "\\uDc00", "\\u0041", "ud800", "\\n", '\\"', "a", "\u00e9"]
    rng = random.Random(7)
    refused = accepted = 0
    for _ in range(3000):
        inner = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8)))
        raw = ('{"k": ["x", "' + inner + '"], "' + rng.choice(["", "\\ud800", "\\ud800\\udc00"]) + '": 1}').encode()
        decoded = json.loads(raw.decode())
        strings = [*decoded["k"], *decoded]
        has_surrogate = any(0xD800 <= ord(ch) <= 0xDFFF for s in strings for ch in s)
        try:
            assert parse_json_body(raw) == decoded
            assert not has_surrogate, raw
            accepted += 1
        except ApiError as err:
            assert has_surrogate and "surrogates not allowed" in err.message, raw
            refused += 1
    assert refused > 500 and accepted > 500, (refused, accepted)


class _CountedPattern:
    """A compiled regex that records the length of every text it scans (how many passes over the body)."""

    def __init__(self, pattern: re.Pattern, scans: list[int]) -> None:
        self.pattern, self.scans = pattern, scans

    def __getattr__(self, name: str):  # noqa: ANN204 - search, sub, finditer, ...: count, then the real one
        real = getattr(self.pattern, name)

        def counted(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            text = next((a for a in (*args, *kw.values()) if isinstance(a, str) and len(a) > 1000), None)
            if text is not None:
                self.scans.append(len(text))
            return real(*args, **kw)

        return counted


@pytest.mark.parametrize("kind", ["token_ids", "text", "escaped_pairs"])
def test_body_check_is_one_scan_beyond_json_decoding(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The body is parsed on the event loop: the surrogate check must not cost a second pass as expensive as
    the decode itself (it re-serialised the whole body with json.dumps: ~2x the decode on a 1.4 MB token list).
    Checked by what the check does, not by a duration: it never serialises, and a body without a suspect escape
    (escaped emoji pairs included) is scanned once by one regex search. What that costs against json.loads is
    a benchmark, measured side by side: benchmarks/bench_body_parse.py (docs/performance.md)."""
    import json

    from octavo.serving import app

    value = {"token_ids": {"prompt": [5 + i % 300 for i in range(300_000)]},
             "text": {"prompt": "The quick brown fox jumps over the lazy dog. " * 35_000},
             "escaped_pairs": {"messages": [{"role": "user", "content": f"turn {i} \U0001F600"} for i in range(30_000)]},
             }[kind]
    raw = json.dumps(value).encode()
    lone = json.dumps({"prompt": "x" * 5000}).replace("xx", "\\ud800", 1).encode()  # a lone surrogate escape

    def no_serialising(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("parse_json_body serialised the body again")

    monkeypatch.setattr(json, "dumps", no_serialising)
    monkeypatch.setattr(json.JSONEncoder, "encode", no_serialising)
    scans: list[int] = []
    for name in ("_SUSPECT", "_SURROGATE_ESCAPE", "_BACKSLASH_OR_PAIR"):
        monkeypatch.setattr(app, name, _CountedPattern(getattr(app, name), scans))
    assert app.parse_json_body(raw) == value
    assert scans == [len(raw)], scans  # one pass over the text (str of ASCII JSON: as long as the bytes)
    with pytest.raises(ApiError, match="surrogates not allowed"):
        app.parse_json_body(lone)  # and a suspect one is refused
    assert len(scans) > 1, scans  # the counting really sees the check's passes
