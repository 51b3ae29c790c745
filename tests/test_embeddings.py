"""Embeddings: an embedding export (sentence-transformers layout -> hidden_states output), LLM.embed and POST
/v1/embeddings, against sentence-transformers on the same random-weight Qwen3 checkpoint (cosine >= 0.99999),
batched with generation, chunked and beside prefix-cache hits; the official openai client for the route."""
from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from embedding_models import make_embedding_model, st_embeddings
from engine_helpers import exported, greedy
from serve_process import serve_in_thread

from octavo import LLM, PoolingParams, SamplingParams
from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.export import export_model
from octavo.runtime.engine_args import EngineArgs

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world",
         "Paris is the capital. " * 6 + "What is the capital of France?",  # longer than one chunk of 32 tokens
         "def fibonacci(n):\n    return n"]
KEY = "sk-embed"


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def st_dirs(hf_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    """pooling -> a sentence-transformers folder of the tiny Qwen3 (normalized), plus 'raw': last, not normalized."""
    base, root = hf_model_dir("qwen3"), tmp_path_factory.mktemp("st")
    dirs = {p: make_embedding_model(root / p, base, p) for p in ("last", "mean", "cls")}
    dirs["raw"] = make_embedding_model(root / "raw", base, "last", normalize=False)
    return dirs


@pytest.fixture(scope="module")
def emb_export(st_dirs, tmp_path_factory):  # noqa: ANN001, ANN201
    out = tmp_path_factory.mktemp("emb") / "model"
    manifest = export_model(st_dirs["last"], out, progress=False)
    assert manifest.pooling == {"type": "last", "normalize": True}  # read from modules.json / 1_Pooling
    return out


@pytest.fixture(scope="module")
def llm(emb_export):  # noqa: ANN001, ANN201
    # chunks of at most 32 tokens: the long text is pooled over several steps
    llm = LLM(str(emb_export), num_blocks=128, block_size=16, max_num_batched_tokens=32, num_threads=1)
    yield llm
    llm.close()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_llm_embed_matches_sentence_transformers(llm, st_dirs, pooling) -> None:  # noqa: ANN001
    ref = st_embeddings(st_dirs[pooling], TEXTS)
    outs = llm.embed(TEXTS, PoolingParams(pooling_type=pooling), use_tqdm=False)
    for text, out, r in zip(TEXTS, outs, ref):
        v = np.array(out.outputs.embedding)
        assert v.shape == r.shape and cosine(v, r) >= 0.99999, (pooling, text)
        assert abs(np.linalg.norm(v) - 1) < 1e-5
    assert llm.engine.stats().num_free_blocks == llm.engine.num_blocks


def test_dimensions_and_normalize(llm, st_dirs) -> None:  # noqa: ANN001
    raw = st_embeddings(st_dirs["raw"], TEXTS)
    outs = llm.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False)
    for out, r in zip(outs, raw):
        v = np.array(out.outputs.embedding)
        assert cosine(v, r) >= 0.99999 and np.allclose(np.linalg.norm(v), np.linalg.norm(r), rtol=1e-4)
    short = llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
    for out, r in zip(short, raw):  # Matryoshka: the first 16 values, then normalized
        v = np.array(out.outputs.embedding)
        assert v.shape == (16,) and cosine(v, r[:16]) >= 0.99999 and abs(np.linalg.norm(v) - 1) < 1e-5
    with pytest.raises(InvalidRequestError, match="hidden size"):
        llm.embed(TEXTS[:1], PoolingParams(dimensions=65), use_tqdm=False)


def test_embeddings_share_steps_with_generation_and_the_prefix_cache(emb_export, st_dirs) -> None:  # noqa: ANN001
    """Embedding requests run in the same steps as a generating request (which gets the tokens it gets alone);
    a mean-pooled prompt whose blocks are in the prefix cache is still pooled over every position, a last-pooled
    one takes the cached blocks; no block is left held."""
    args = dict(num_blocks=128, block_size=16, max_num_batched_tokens=32, num_threads=1)
    prompt = "Once upon a time there was a small engine"
    llm = LLM(str(emb_export), **args)
    try:
        alone = llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.close()
    llm = LLM(str(emb_export), **args)
    try:
        engine = llm.engine
        mixed: list[set[bool]] = []
        engine.add_step_listener(lambda rec: mixed.append({r.pool is not None for r in rec.scheduled}))
        engine.add_request("gen", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                          output_kind="final_only"))
        pool = SamplingParams(max_tokens=1, pooling=PoolingParams(pooling_type="mean"), output_kind="final_only")
        for i, text in enumerate(TEXTS * 2):  # each text twice: the second finds the first's blocks cached
            engine.add_request(f"e{i}", text, pool)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert done["gen"].outputs[0].token_ids == alone
        assert any(kinds == {True, False} for kinds in mixed)  # a step with both kinds of rows
        ref = st_embeddings(st_dirs["mean"], TEXTS)
        for i in range(len(TEXTS) * 2):
            assert cosine(done[f"e{i}"].embedding, ref[i % len(TEXTS)]) >= 0.99999
            assert done[f"e{i}"].outputs[0].token_ids == []  # nothing sampled
        hits = engine.stats().prefix_cache_hits
        last = llm.embed([TEXTS[2]], use_tqdm=False)[0].outputs.embedding  # its full blocks are cached by now
        assert engine.stats().prefix_cache_hits > hits
        assert cosine(np.array(last), st_embeddings(st_dirs["last"], [TEXTS[2]])[0]) >= 0.99999
        assert engine.stats().num_free_blocks == engine.num_blocks
    finally:
        llm.close()


def test_generative_export_refuses_embeddings(hf_model_dir) -> None:  # noqa: ANN001
    llm = LLM(str(exported(hf_model_dir("llama"))), num_blocks=32, num_threads=1)
    try:
        with pytest.raises(InvalidRequestError, match="--pooling"):
            llm.embed(["hello"], use_tqdm=False)
    finally:
        llm.close()


def test_export_pooling_flag_and_unsupported_modules(hf_model_dir, st_dirs, tmp_path) -> None:  # noqa: ANN001
    m = export_model(hf_model_dir("qwen3"), tmp_path / "a", progress=False, pooling="mean")
    assert m.pooling == {"type": "mean", "normalize": True}
    assert json.loads((tmp_path / "a" / "octavo.json").read_text())["pooling"]["type"] == "mean"
    assert "pooling" not in json.loads((exported(hf_model_dir("llama")) / "octavo.json").read_text())
    bad = make_embedding_model(tmp_path / "dense", hf_model_dir("qwen3"))
    modules = json.loads((bad / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (bad / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelFormatError, match="Dense"):
        export_model(bad, tmp_path / "b", progress=False)


# ---------------------------------------------------------------------------------------------------
# POST /v1/embeddings


@pytest.fixture(scope="module")
def server(emb_export):  # noqa: ANN001, ANN201
    args = EngineArgs(model=str(emb_export), num_blocks=128, block_size=16, max_num_batched_tokens=64, num_threads=1)
    with serve_in_thread(args, served_model_names=("emb",), api_key=KEY) as s:
        yield s


@pytest.fixture()
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def test_openai_client_embeddings(client, st_dirs) -> None:  # noqa: ANN001
    ref = st_embeddings(st_dirs["last"], TEXTS)
    res = client.embeddings.create(model="emb", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in res.data] == list(range(len(TEXTS))) and res.model == "emb"
    for d, r in zip(res.data, ref):
        assert cosine(np.array(d.embedding), r) >= 0.99999
    floats = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, res.data[0].embedding, atol=1e-6)
    short = client.embeddings.create(model="emb", input=TEXTS[:2], dimensions=8)
    raw = st_embeddings(st_dirs["raw"], TEXTS[:2])
    for d, r in zip(short.data, raw):
        assert len(d.embedding) == 8 and cosine(np.array(d.embedding), r[:8]) >= 0.99999
    ids = [[5, 6, 7, 8], [9, 10]]
    by_ids = client.embeddings.create(model="emb", input=ids)
    assert res.usage.prompt_tokens > 0 and by_ids.usage.prompt_tokens == 6 == by_ids.usage.total_tokens


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"), ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[1, 2], "x"]}, "input"), ({"input": [[10**6]]}, "input"), ({"input": ["a"] * 2049}, "input"),
    ({"input": {"a": 1}}, "input"), ({"input": "hi", "normalize": "yes"}, "normalize"),
])
def test_bad_embedding_requests_are_400(server, body, param) -> None:  # noqa: ANN001
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": "emb", **body},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings_auth_and_model(server) -> None:  # noqa: ANN001
    assert httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi"}).status_code == 401
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": "other", "input": "hi"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_generative_model_answers_400(hf_model_dir) -> None:  # noqa: ANN001
    args = EngineArgs(model=str(exported(hf_model_dir("llama"))), num_blocks=32, num_threads=1)
    with serve_in_thread(args, served_model_names=("gen",)) as s:
        r = httpx.post(s.base_url + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"


def test_preempted_embedding_requests_pool_each_position_once(emb_export, st_dirs) -> None:  # noqa: ANN001
    """A pool too small for everything at once: embedding requests are preempted mid-prompt and recomputed
    (with the prefix cache offering their earlier blocks); mean and last pooling still equal the reference."""
    llm = LLM(str(emb_export), num_blocks=7, block_size=16, max_num_batched_tokens=48, num_threads=1)
    try:
        engine = llm.engine
        engine.add_request("gen", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True,
                                                                     output_kind="final_only"))
        sentences = ["Paris is the capital. ", "Solve: if x + 3 = 7 then x = 4. ", "Héllo wörld, naïve café. ",
                     "Write an essay about memory and paging. "]
        long = [" ".join(sentences[(i + j) % 4] for j in range(6)) for i in range(4)]  # ~75 tokens, distinct
        for i, text in enumerate(long):
            pooling = "last" if i == 3 else "mean"
            engine.add_request(f"{pooling}{i}", text, SamplingParams(
                max_tokens=1, pooling=PoolingParams(pooling_type=pooling), output_kind="final_only"))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert engine.stats().num_preemptions > 0  # the case this test is about
        for i, text in enumerate(long):
            pooling = "last" if i == 3 else "mean"
            ref = st_embeddings(st_dirs[pooling], [text])[0]
            assert cosine(done[f"{pooling}{i}"].embedding, ref) >= 0.99999, (pooling, i)
        assert engine.stats().num_free_blocks == engine.num_blocks
    finally:
        llm.close()
