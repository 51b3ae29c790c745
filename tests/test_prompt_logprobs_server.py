"""Prompt logprobs over HTTP: /v1/completions echo + logprobs (OpenAI's legacy shape), max_tokens 0 (score
only), vLLM's prompt_logprobs, streamed and batched, with the official `openai` client and httpx against a real
server on the real engine. Reference: transformers' log_softmax of the same checkpoint's full-sequence logits."""
from __future__ import annotations

import math

import httpx
import numpy as np
import openai
import pytest
from engine_helpers import exported, hf_prompt_logits, hf_reference
from serve_process import serve_in_thread

from octavo.runtime.engine_args import EngineArgs

NAME = "tiny"
TOL = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital."


@pytest.fixture(scope="module")
def src(hf_dir):  # noqa: ANN001, ANN201
    return hf_dir


@pytest.fixture(scope="module")
def server(src):  # noqa: ANN001, ANN201
    ea = EngineArgs(model=str(exported(src)), num_blocks=128, block_size=16, max_num_seqs=16, num_threads=1,
                    max_num_batched_tokens=24)  # prompts of ~30 tokens go in several chunks
    with serve_in_thread(ea, served_model_names=(NAME,)) as s:
        yield s


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def http(server):  # noqa: ANN001, ANN201
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def _ids(http, text: str) -> list[int]:  # noqa: ANN001
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def _ref(src, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    import torch

    return torch.log_softmax(torch.from_numpy(hf_prompt_logits(src, ids)).double(), dim=-1).numpy()


def _check_legacy_prompt(lp, ids: list[int], ref: np.ndarray, k: int, decode) -> None:  # noqa: ANN001
    """The echoed prompt's part of legacy logprobs: first null, then transformers' values and top k."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [decode(t) for t in ids]
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1][ids[p]]) < TOL, p
        want: dict[str, float] = {}  # top k then the prompt token, keyed by text: tokens that read alike merge
        for t in [*np.argsort(-ref[p - 1], kind="stable")[:k].tolist(), ids[p]]:
            want.setdefault(decode(t), ref[p - 1][t])
        got = lp.top_logprobs[p]
        assert set(got) == set(want), p
        np.testing.assert_allclose([got[t] for t in want], list(want.values()), atol=TOL, rtol=0)
    offs = lp.text_offset
    assert offs[0] == 0 and all(offs[i + 1] == offs[i] + len(lp.tokens[i]) for i in range(len(offs) - 1))


@pytest.fixture(scope="module")
def decode(server):  # noqa: ANN001, ANN201
    tok = server.server.state.tokenizer
    return lambda t: tok.decode([t], skip_special_tokens=False)  # how logprobs show tokens


def test_echo_logprobs_legacy_shape_matches_transformers(client, http, src, decode) -> None:  # noqa: ANN001
    ids = _ids(http, TEXT)
    assert len(ids) > 24  # several prefill chunks
    r = client.completions.create(model=NAME, prompt=TEXT, echo=True, logprobs=3, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    ch = r.choices[0]
    gen = hf_reference(src, ids, 4)
    assert ch.text == TEXT + "".join(decode(t) for t in gen) or ch.text.startswith(TEXT)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + 4 and len(lp.token_logprobs) == len(ids) + 4
    _check_legacy_prompt(lp, ids, _ref(src, ids), 3, decode)
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[len(ids):])  # then the generated tokens
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4


def test_score_only_max_tokens_0(client, http, src, decode) -> None:  # noqa: ANN001
    ids = _ids(http, TEXT)
    r = client.completions.create(model=NAME, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    ch = r.choices[0]
    assert ch.text == TEXT and len(ch.logprobs.tokens) == len(ids) and ch.finish_reason == "length"
    _check_legacy_prompt(ch.logprobs, ids, _ref(src, ids), 1, decode)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    # echo without logprobs, max_tokens 0: the prompt back, nothing generated
    r = client.completions.create(model=NAME, prompt=TEXT, echo=True, max_tokens=0)
    assert r.choices[0].text == TEXT and r.choices[0].logprobs is None and r.usage.completion_tokens == 0


def test_lm_eval_loglikelihood_payload(http, src) -> None:  # noqa: ANN001
    """What lm-evaluation-harness's local-completions sends for a loglikelihood request (token ids, a batch),
    and how it reads the answer: sum(token_logprobs[ctxlen:-1]) and greedy = each token is its position's top."""
    ctx, cont = _ids(http, "Question: What is the capital of France?\nAnswer:"), _ids(http, " Paris")
    other = _ids(http, "Once upon a time there was a small engine")
    body = {"model": NAME, "prompt": [ctx + cont, other], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    choices = sorted(http.post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
    seq = ctx + cont
    ref = _ref(src, seq)
    lp = choices[0]["logprobs"]
    got = sum(lp["token_logprobs"][len(ctx):-1])
    want = sum(ref[p - 1][seq[p]] for p in range(len(ctx), len(seq)))
    assert abs(got - want) < TOL * len(cont)
    greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][len(ctx):-1],
                                                         lp["top_logprobs"][len(ctx):-1]))
    assert greedy == all(int(np.argmax(ref[p - 1])) == seq[p] for p in range(len(ctx), len(seq)))
    assert len(choices[1]["logprobs"]["tokens"]) == len(other) + 1


def test_vllm_prompt_logprobs_field(http, src) -> None:  # noqa: ANN001
    ids = _ids(http, TEXT)
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    plp = ch["prompt_logprobs"]
    ref = _ref(src, ids)
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p]
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - ref[p - 1][ids[p]]) < TOL
        assert mine["rank"] == int((ref[p - 1] > ref[p - 1][ids[p]] + 1e-6).sum()) + 1 or mine["rank"] <= 2
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked[:2]] == [1, 2] and isinstance(ranked[0]["decoded_token"], str)
        assert len(entry) in (2, 3)  # top 2, plus the prompt token when it is not among them
    assert ch["logprobs"] is None  # the generated tokens' logprobs were not asked for
    # not asked: null (vLLM always sends the key), and nothing computed
    assert http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()["choices"][0][
        "prompt_logprobs"] is None


def test_streamed_echo_logprobs_equal_the_whole_response(client) -> None:  # noqa: ANN001
    kw = dict(model=NAME, prompt=TEXT, echo=True, logprobs=2, max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    text, tokens, lps, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert lps[0] is None and all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(lps[1:], whole.logprobs.token_logprobs[1:]))


def test_n_and_batches_each_carry_their_prompt(client, http) -> None:  # noqa: ANN001
    prompts = ["Hello world, this is a test", "Solve: if x + 3 = 7 then x = 4."]
    r = client.completions.create(model=NAME, prompt=prompts, echo=True, logprobs=0, max_tokens=2, n=2,
                                  temperature=0.7, seed=3)
    assert len(r.choices) == 4
    for c in r.choices:
        ids = _ids(http, prompts[c.index // 2])
        assert c.text.startswith(prompts[c.index // 2])
        assert len(c.logprobs.tokens) == len(ids) + 2 and c.logprobs.token_logprobs[0] is None
    first = [c.logprobs.token_logprobs[: len(_ids(http, prompts[0]))] for c in r.choices[:2]]
    assert first[0] == first[1]  # both choices of a prompt echo the same prompt scores


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
])
def test_bad_scoring_requests_are_400(http, body: dict, param: str) -> None:  # noqa: ANN001
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_streamed_prompt_logprobs_come_with_each_choices_first_chunk(http) -> None:  # noqa: ANN001
    import json

    ids = _ids(http, TEXT)
    body = {"prompt": [ids, ids[:7]], "max_tokens": 3, "prompt_logprobs": 1, "stream": True, "temperature": 0}
    firsts: dict[int, dict] = {}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1]
    assert len(firsts[0]["prompt_logprobs"]) == len(ids) and len(firsts[1]["prompt_logprobs"]) == 7
    assert firsts[0]["prompt_logprobs"][0] is None and str(ids[1]) in firsts[0]["prompt_logprobs"][1]


def test_prompt_logprob_entries_per_request_are_bounded(src) -> None:  # noqa: ANN001
    """docs/security.md: prompt tokens x (top-k + 1) past --max-prompt-logprob-entries is a 400 naming the
    numbers (issue 48: echo + logprobs 20 on an 8,190-token prompt took 34 s and 516 MB); under it, the same
    prompt is scored."""
    ea = EngineArgs(model=str(exported(src)), num_blocks=128, block_size=16, max_num_seqs=4, num_threads=1,
                    max_prompt_logprob_entries=100)
    with serve_in_thread(ea, served_model_names=(NAME,)) as s, httpx.Client(base_url=s.base_url, timeout=60) as c:
        ids = list(range(5, 30))  # 25 tokens: 24 scored
        r = c.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                             "logprobs": 20})
        assert r.status_code == 400 and "504 logprob entries" in r.json()["error"]["message"], r.text
        assert "--max-prompt-logprob-entries" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                             "logprobs": 3})  # 24 x 4 = 96 entries
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 25
