"""vLLM drop-in, round two (issue 47), against a real `octavo serve` process with the official `openai` client
(httpx where the SDK has no field): tool schemas with $defs under tool_choice "required", allowed_token_ids,
logprob_token_ids, prompt_logprobs on chat, the always-present prompt_logprobs / reasoning keys, echo of token-id
prompts, truncate_prompt_tokens / truncation_side, POST /v1/chat/completions/batch, the vocabulary size in
out-of-vocabulary errors and --max-logprobs. References: transformers (the model's log-softmax, its tokenizer and
chat template), pydantic (tool arguments), the server's own single-conversation route (batch)."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from engine_helpers import exported
from serve_process import serve_in_thread, serving

from octavo import LLM, SamplingParams
from octavo.errors import InvalidRequestError
from octavo.runtime.engine_args import EngineArgs

NAME = "tiny"
VOCAB = 384
MSGS = [{"role": "user", "content": "Say something about paging."}]


@pytest.fixture(scope="module")
def model_dir(hf_dir):  # noqa: ANN001, ANN201
    return exported(hf_dir)


@pytest.fixture(scope="module")
def url(model_dir):  # noqa: ANN001, ANN201
    with serving([str(model_dir), "--port", "0", "--num-blocks", "256", "--num-threads", "1",
                  "--served-model-name", NAME, "--shutdown-timeout", "5"]) as (_, base):
        yield base


@pytest.fixture()
def client(url):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tok(hf_dir):  # noqa: ANN001, ANN201
    import transformers

    return transformers.AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def hf_model(hf_dir):  # noqa: ANN001, ANN201
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    return m.eval()


def next_logprobs(hf_model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """[len(ids), vocab]: transformers' log-softmax of the next-token logits after each prefix of IDS."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def template_ids(hf_tok, messages: list[dict]) -> list[int]:  # noqa: ANN001
    return list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": NAME, **body}, timeout=120)


def err(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ------------------------------------------------------------------------------------------------
# 1. tool_choice "required" with pydantic-generated parameters ($defs, local $ref)


def test_required_tool_choice_with_defs_gives_valid_arguments(client) -> None:  # noqa: ANN001
    import pydantic

    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=4)
        zip: int = pydantic.Field(ge=0, le=99)

    class Ship(pydantic.BaseModel):
        to: Address
        items: list[Address] = pydantic.Field(max_length=1)

    params = Ship.model_json_schema()
    assert "$defs" in params  # what agent frameworks send
    tools = [{"type": "function", "function": {"name": "ship", "parameters": params}}]
    r = client.chat.completions.create(model=NAME, messages=MSGS, tools=tools, tool_choice="required", n=6,
                                       temperature=1.0, seed=3, max_tokens=300, parallel_tool_calls=False)
    done = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert done, [c.finish_reason for c in r.choices]
    for c in done:
        (call,) = c.message.tool_calls
        assert call.function.name == "ship"
        Ship.model_validate_json(call.function.arguments)  # the schema, $ref'd definitions included, is kept


# ------------------------------------------------------------------------------------------------
# 2. allowed_token_ids, logprob_token_ids


def test_allowed_token_ids_greedy_is_the_argmax_over_the_allowed(client, hf_model) -> None:  # noqa: ANN001
    prompt = [1, 45, 67, 89, 120, 7]
    allowed = [5, 17, 42, 100, 250, 383]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0.0,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    ids, want = list(prompt), []
    for _ in range(6):
        lp = next_logprobs(hf_model, ids)[-1]
        want.append(allowed[int(np.argmax(lp[allowed]))])
        ids.append(want[-1])
    assert got == want
    # sampled and streamed: every token is one of them
    stream = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=12, temperature=1.0, seed=5,
                                            stream=True, extra_body={"allowed_token_ids": allowed[:3],
                                                                     "return_token_ids": True})
    toks = [t for ch in stream for c in ch.choices for t in c.model_extra.get("token_ids") or []]
    assert toks and set(toks) <= set(allowed[:3])


@pytest.mark.parametrize("body, words", [
    ({"allowed_token_ids": []}, ["empty"]),
    ({"allowed_token_ids": [3, 400, 999]}, ["400", "999", "vocabulary size 384"]),
    ({"allowed_token_ids": list(range(385))}, ["385", "384"]),
    ({"logprob_token_ids": [1, 2]}, ["logprobs"]),
    ({"logprob_token_ids": [1, 2], "logprobs": 2, "use_beam_search": True}, ["beam search"]),
    ({"logprob_token_ids": list(range(129)), "logprobs": 1}, ["129", "128"]),
    ({"logprob_token_ids": [1, 500], "logprobs": 1}, ["500", "vocabulary size 384"]),
    ({"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0}, ["max_tokens"]),
    ({"allowed_token_ids": [1, 2], "use_beam_search": True, "n": 2}, ["beam"]),
])
def test_token_id_lists_are_bounded_and_checked(url, body, words) -> None:  # noqa: ANN001
    e = err(post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body}))
    assert e["param"] in ("allowed_token_ids", "logprob_token_ids", "use_beam_search", "logprobs", None), e
    for w in words:
        assert w in e["message"], (w, e["message"])


def test_logprob_token_ids_give_exactly_those_tokens(client, url, hf_tok, hf_model) -> None:  # noqa: ANN001
    asked = [3, 7, 11, 200]
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=3, temperature=0.0, logprobs=True,
                                       top_logprobs=5, extra_body={"logprob_token_ids": asked,
                                                                   "return_tokens_as_token_ids": True,
                                                                   "return_token_ids": True})
    out = r.choices[0].model_extra["token_ids"]
    ref = next_logprobs(hf_model, template_ids(hf_tok, MSGS) + out)[-len(out) - 1:-1]
    for pos, item in enumerate(r.choices[0].logprobs.content):
        shown = [int(t.token.split(":")[1]) for t in item.top_logprobs]
        assert shown == list(dict.fromkeys([out[pos], *asked]))  # the chosen token, then exactly the asked ids
        for t, tid in zip(item.top_logprobs, shown):
            assert t.logprob == pytest.approx(float(ref[pos][tid]), abs=2e-3)
    # streamed: the same entries
    chunks = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=3, temperature=0.0, logprobs=True,
                                            stream=True, extra_body={"logprob_token_ids": asked,
                                                                     "return_tokens_as_token_ids": True})
    items = [i for ch in chunks for c in ch.choices if c.logprobs for i in c.logprobs.content]
    assert [[t.token for t in i.top_logprobs] for i in items] == \
        [[t.token for t in i.top_logprobs] for i in r.choices[0].logprobs.content]
    # completions: legacy top_logprobs hold the chosen token and the asked ones
    c = client.completions.create(model=NAME, prompt=[1, 5, 9], max_tokens=2, temperature=0.0, logprobs=1,
                                  extra_body={"logprob_token_ids": asked, "return_tokens_as_token_ids": True})
    lp = c.choices[0].logprobs
    for tok, top in zip(lp.tokens, lp.top_logprobs):
        assert list(top) == list(dict.fromkeys([tok, *(f"token_id:{a}" for a in asked)]))
    assert err(post(url, "/v1/chat/completions", {"messages": MSGS, "logprob_token_ids": [1]}))["param"] == \
        "logprob_token_ids"


# ------------------------------------------------------------------------------------------------
# 3, 4. prompt_logprobs on chat; prompt_logprobs / reasoning always present


def test_chat_prompt_logprobs_score_the_templated_prompt(client, url, hf_tok, hf_model) -> None:  # noqa: ANN001
    ids = template_ids(hf_tok, MSGS)
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, temperature=0.0,
                                       extra_body={"prompt_logprobs": 2})
    pl = r.model_extra["prompt_logprobs"]
    assert r.usage.prompt_tokens == len(ids) and len(pl) == len(ids) and pl[0] is None
    ref = next_logprobs(hf_model, ids)
    for p in range(1, len(ids)):
        entry = pl[p]
        assert str(ids[p]) in entry and len(entry) in (2, 3)  # the top 2 and the prompt's own token
        assert entry[str(ids[p])]["logprob"] == pytest.approx(float(ref[p - 1][ids[p]]), abs=2e-3)
        assert entry[str(ids[p])]["rank"] == 1 + int(np.sum(ref[p - 1] > ref[p - 1][ids[p]] + 1e-6))
    # the same as /v1/completions on the template's token ids
    c = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    assert c["choices"][0]["prompt_logprobs"] == pl
    e = err(post(url, "/v1/chat/completions", {"messages": MSGS, "stream": True, "prompt_logprobs": 1}))
    assert e["param"] == "prompt_logprobs" and "stream" in e["message"]


def test_prompt_logprobs_and_reasoning_keys_are_always_there(client) -> None:  # noqa: ANN001
    c = client.completions.create(model=NAME, prompt="Hello", max_tokens=2)
    assert "prompt_logprobs" in c.choices[0].model_extra and c.choices[0].prompt_logprobs is None
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2)
    assert "prompt_logprobs" in r.model_extra and r.prompt_logprobs is None
    assert "reasoning" in r.choices[0].message.model_extra and r.choices[0].message.reasoning is None
    deltas = [c.delta for ch in client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=3, stream=True)
              for c in ch.choices]
    assert deltas and all("reasoning" in d.model_extra and d.reasoning is None for d in deltas)


# ------------------------------------------------------------------------------------------------
# 5. echo with a token-id prompt


def test_echo_of_token_ids_keeps_special_tokens_and_agrees_with_text_offset(client, hf_tok) -> None:  # noqa: ANN001
    specials = [t for t in (hf_tok.bos_token_id, hf_tok.eos_token_id) if t is not None]
    assert specials
    ids = [specials[0], 40, 41, 42, specials[-1], 43, 44]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0.0, echo=True, logprobs=0)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    echoed = hf_tok.decode(ids, skip_special_tokens=False)
    assert text.startswith(echoed)
    offs = lp.text_offset
    assert offs[len(ids)] == len(echoed)  # the generated text starts where the echo ends
    for i, tok in enumerate(lp.tokens[:len(ids)]):  # each token's text sits at its offset
        assert text[offs[i]:offs[i] + len(tok)] == tok
    streamed = list(client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0.0, echo=True,
                                              logprobs=0, stream=True))
    assert "".join(c.text for ch in streamed for c in ch.choices) == text
    assert [o for ch in streamed for c in ch.choices if c.logprobs for o in c.logprobs.text_offset] == offs


# ------------------------------------------------------------------------------------------------
# 6. truncate_prompt_tokens / truncation_side


def test_truncation_keeps_the_asked_side(client, url, hf_tok) -> None:  # noqa: ANN001
    ids = list(range(20, 50))
    for side, want in (("left", ids[-8:]), ("right", ids[:8]), (None, ids[-8:])):
        extra = {"truncate_prompt_tokens": 8, "return_token_ids": True, **({"truncation_side": side} if side else {})}
        r = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0.0, extra_body=extra)
        assert r.choices[0].model_extra["prompt_token_ids"] == want and r.usage.prompt_tokens == 8
        ref = client.completions.create(model=NAME, prompt=want, max_tokens=3, temperature=0.0)
        assert r.choices[0].text == ref.choices[0].text
    text = "one two three four five six seven eight nine ten"
    r = client.completions.create(model=NAME, prompt=text, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 4, "return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] == hf_tok(text).input_ids[-4:]
    # chat: the templated tokens, streamed too
    tmpl = template_ids(hf_tok, MSGS)
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, extra_body={
        "truncate_prompt_tokens": 5, "truncation_side": "right", "return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == tmpl[:5] and r.usage.prompt_tokens == 5
    first = next(iter(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, stream=True,
                                                      extra_body={"truncate_prompt_tokens": 6,
                                                                  "return_token_ids": True})))
    assert first.model_extra["prompt_token_ids"] == tmpl[-6:]


def test_truncation_to_the_context_and_its_bounds(client, url) -> None:  # noqa: ANN001
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    long = [i % 300 + 10 for i in range(max_len + 40)]
    r = client.completions.create(model=NAME, prompt=long, max_tokens=4, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == max_len - 4
    e = err(post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4,
                                          "truncate_prompt_tokens": max_len - 3}))
    assert e["param"] == "truncate_prompt_tokens" and str(max_len - 4) in e["message"]
    e = err(post(url, "/v1/chat/completions", {"messages": MSGS, "truncate_prompt_tokens": 4,
                                               "truncation_side": "middle"}))
    assert e["param"] == "truncation_side"


# ------------------------------------------------------------------------------------------------
# 7. POST /v1/chat/completions/batch


def test_batch_chat_answers_each_conversation_as_the_single_route(client, url) -> None:  # noqa: ANN001
    convs = [MSGS, [{"role": "user", "content": "Count to three."}],
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]]
    r = post(url, "/v1/chat/completions/batch", {"messages": convs, "max_tokens": 5, "temperature": 0.0,
                                                 "echo": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    prompt_tokens = 0
    for conv, choice in zip(convs, body["choices"]):
        one = client.chat.completions.create(model=NAME, messages=conv, max_tokens=5, temperature=0.0,
                                             extra_body={"echo": True, "return_token_ids": True})
        assert choice["message"]["content"] == one.choices[0].message.content
        assert choice["token_ids"] == one.choices[0].model_extra["token_ids"]
        prompt_tokens += one.usage.prompt_tokens
    assert body["choices"][2]["message"]["content"].startswith("Well,")  # echo, per conversation
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


@pytest.mark.parametrize("body, param, status", [
    ({"stream": True}, "stream", 400),
    ({"n": 2}, "n", 400),
    ({"use_beam_search": True}, "use_beam_search", 400),
    ({"prompt_logprobs": 1}, "prompt_logprobs", 400),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools", 400),
    ({"messages": [MSGS] * 65}, "messages", 400),
    ({"messages": [MSGS, []]}, "messages", 400),
    ({"messages": MSGS}, "messages", 400),
    ({"messages": [MSGS, [{"role": 5, "content": "x"}]]}, "messages", 400),
])
def test_batch_chat_refusals(url, body, param, status) -> None:  # noqa: ANN001
    e = err(post(url, "/v1/chat/completions/batch", {"messages": [MSGS], "max_tokens": 2, **body}), status)
    assert e["param"] == param, e


def test_batch_chat_body_is_capped(url) -> None:  # noqa: ANN001
    huge = [[{"role": "user", "content": "x" * (1 << 20)}]] * 5  # 5 MB: over the default --max-body-bytes (4M)
    r = httpx.post(url + "/v1/chat/completions/batch", json={"messages": huge}, timeout=120)
    assert r.status_code == 413, r.text[:300]


# ------------------------------------------------------------------------------------------------
# 8, 9. the vocabulary size in errors; --max-logprobs


@pytest.mark.parametrize("field, value", [("repetition_detection", {"max_pattern_size": 4, "min_count": 2}),
                                          ("prompt_logprob_token_ids", [1]), ("watermarking", True)])
def test_newer_vllm_sampling_fields_are_refused_not_ignored(url, field: str, value: object) -> None:  # noqa: ANN001
    assert err(post(url, "/v1/chat/completions", {"messages": MSGS, field: value}))["param"] == field
    assert post(url, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, field: None}).status_code == 200


def test_logit_bias_out_of_range_names_the_vocabulary_size(url) -> None:  # noqa: ANN001
    e = err(post(url, "/v1/completions", {"prompt": "x", "logit_bias": {"384": 1, "5": 1}}))
    assert e["param"] == "logit_bias" and "384" in e["message"] and "vocabulary size 384" in e["message"] \
        and "allowed: 0 to 383" in e["message"]


def test_max_logprobs_default_is_20(url) -> None:  # noqa: ANN001
    e = err(post(url, "/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}))
    assert e["param"] == "top_logprobs" and "max allowed: 20" in e["message"]
    e = err(post(url, "/v1/completions", {"prompt": "x", "logprobs": -1}))
    assert e["param"] == "logprobs" and "--max-logprobs" in e["message"]


def test_max_logprobs_minus_one_allows_the_vocabulary_within_the_entry_budget(model_dir) -> None:  # noqa: ANN001
    ea = EngineArgs(model=str(model_dir), num_blocks=64, num_threads=1, max_logprobs=-1)
    with serve_in_thread(ea, served_model_names=(NAME,)) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, logprobs=True, top_logprobs=-1)
        for item in r.choices[0].logprobs.content:
            lps = np.array([t.logprob for t in item.top_logprobs])
            assert len({t.token for t in item.top_logprobs}) <= VOCAB and len(lps) >= VOCAB - 16  # merged texts
            assert np.all(np.diff(lps) <= 1e-6)  # most likely first
        c = client.completions.create(model=NAME, prompt=[1, 5, 9], max_tokens=1, extra_body={"prompt_logprobs": -1})
        assert all(len(e) == VOCAB for e in c.choices[0].model_extra["prompt_logprobs"][1:])
        sums = [sum(np.exp(v["logprob"]) for v in e.values()) for e in c.choices[0].model_extra["prompt_logprobs"][1:]]
        assert sums == pytest.approx([1.0] * len(sums), abs=1e-3)
        max_len = client.models.list().data[0].model_extra["max_model_len"]
        e = err(post(s.base_url, "/v1/completions", {"prompt": "x", "logprobs": -1, "max_tokens": max_len - 10}))
        assert "logprob entries" in e["message"]


def test_library_max_logprobs(model_dir) -> None:  # noqa: ANN001
    """The engine owns the bound: LLM(max_logprobs=...) refuses more, and resolves -1 to the vocabulary."""
    llm = LLM(str(model_dir), num_blocks=32, num_threads=1)
    try:
        with pytest.raises(InvalidRequestError, match="max allowed: 20"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=21))
        with pytest.raises(InvalidRequestError, match="logprob_token_ids"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=1, logprob_token_ids=[999]))
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=[7, 9]))
        assert set(out[0].outputs[0].token_ids) <= {7, 9}
    finally:
        llm.close()
    llm = LLM(str(model_dir), num_blocks=32, num_threads=1, max_logprobs=-1)
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=-1))
        assert all(len(e) == VOCAB for e in out[0].prompt_logprobs[1:])
    finally:
        llm.close()
