"""octavo.LLM on the real exported model: prefix-cache hits never change outputs (hypothesis, few
examples, vs HF), seeded sampling independent of the batch, n > 1 sharing prompt blocks, trace file."""
from __future__ import annotations

import json

import pytest
from engine_helpers import exported, greedy, hf_reference, seed10_requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(hf_model_dir):  # noqa: ANN001, ANN201
    hf = hf_model_dir("qwen2")
    return hf, exported(hf)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.lists(st.integers(5, 383), min_size=16, max_size=64),
       suffixes=st.lists(st.lists(st.integers(5, 383), min_size=1, max_size=12), min_size=2, max_size=4),
       block_size=st.sampled_from([4, 8, 16]), max_tokens=st.integers(2, 8))
def test_prefix_hits_never_change_outputs(model, prefix, suffixes, block_size, max_tokens) -> None:  # noqa: ANN001
    hf, folder = model
    prompts = [prefix + s for s in suffixes] + [prefix]
    llm = LLM(str(folder), num_blocks=64, block_size=block_size, max_num_batched_tokens=24)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(max_tokens), use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy(max_tokens), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits >= (len(prompts) - 1) * ((len(prefix) - 1) // block_size) * block_size
    for p, o in zip(prompts[1:], rest):  # the shared prefix's full blocks, never the prompt's last token
        assert o.num_cached_tokens >= min(len(prefix), len(p) - 1) // block_size * block_size
    for p, o in zip(prompts, first + rest):
        assert o.outputs[0].token_ids == hf_reference(hf, p, max_tokens)


def test_seeded_sampling_on_the_real_model(model) -> None:  # noqa: ANN001
    _, folder = model
    llm = LLM(str(folder), num_blocks=128, max_num_batched_tokens=32)
    tok = llm.get_tokenizer()
    target = {"prompt_token_ids": tok.encode("Once upon a time there was")}
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=2026, max_tokens=24, ignore_eos=True)
    alone = llm.generate(target, sp, use_tqdm=False)[0].outputs[0].token_ids
    mix = [{"prompt_token_ids": p} for p, _ in seed10_requests(tok)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=m, ignore_eos=True)
              for i, (_, m) in enumerate(seed10_requests(tok))]
    outs = llm.generate(mix[:4] + [target] + mix[4:], params[:4] + [sp] + params[4:], use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone
    again = LLM(str(folder), num_blocks=16, block_size=4).generate(target, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone  # another pool shape, another engine: same tokens


def test_n_completions_share_prompt_blocks(model) -> None:  # noqa: ANN001
    hf, folder = model
    llm = LLM(str(folder), num_blocks=64, block_size=8)
    prompt = list(range(10, 60))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    ref = hf_reference(hf, prompt, 6)
    assert [c.token_ids for c in out.outputs] == [ref] * 4
    assert llm.engine.stats().prefix_cache_hits == 3 * 48  # children 1-3: 6 of the 7 blocks (never the last token)
    assert llm.engine.stats().num_free_blocks == 64


def test_trace_of_the_seed_mix(model, tmp_path) -> None:  # noqa: ANN001
    _, folder = model
    path = tmp_path / "seed.jsonl"
    llm = LLM(str(folder), num_blocks=48, block_size=16, trace_path=str(path))
    reqs = seed10_requests(llm.get_tokenizer())
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [greedy(m) for _, m in reqs], use_tqdm=False)
    llm.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows[0]["arrived"]) == 10
    finished = {f["id"]: f["reason"] for r in rows for f in r["finished"]}
    assert set(finished) == {o.request_id for o in outs} and set(finished.values()) == {"length"}
    assert min(r["free_blocks"] for r in rows) < rows[-1]["free_blocks"] == 48
    for o, (p, m) in zip(outs, reqs):
        spans = [q for r in rows for q in r["requests"] if q["id"] == o.request_id]
        assert spans[-1]["total_len"] == len(p) + m - 1  # the last sampled token never enters the cache
        assert spans[-1]["blocks"] == -(-(len(p) + m - 1) // 16)
        assert sum(q["tokens"] for q in spans) == len(p) + m - 1 or o.metrics.num_preemptions > 0
