"""Greedy outputs token-identical to HF transformers, however the engine batches, chunks, preempts or
caches: the seed's 10-request mix and random requests on two architectures."""
from __future__ import annotations

import pytest
from engine_helpers import exported, hf_reference, random_requests, seed10_requests, shared_prefix_requests

from octavo import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3window"]


def _run(llm: LLM, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, (p, m) in zip(outs, reqs):
        assert o.prompt_token_ids == p and o.finished and o.outputs[0].finish_reason == "length"
        assert len(o.outputs[0].token_ids) == m
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


def _check(hf_dir, reqs, got) -> None:  # noqa: ANN001
    for i, ((p, m), toks) in enumerate(zip(reqs, got)):
        assert toks == hf_reference(hf_dir, p, m), f"request {i} (prompt {len(p)} tokens) differs from HF"


def _workload(llm: LLM, n_random: int) -> list[tuple[list[int], int]]:
    return seed10_requests(llm.get_tokenizer()) + random_requests(n_random, seed=1)


@pytest.fixture(scope="module", params=ARCHS)
def model(request, hf_model_dir):  # noqa: ANN001, ANN201
    hf = hf_model_dir(request.param)
    return hf, exported(hf)


def test_seed_mix_alone_and_all_at_once(model) -> None:  # noqa: ANN001
    hf, folder = model
    llm = LLM(str(folder), num_blocks=256, max_num_seqs=64, max_num_batched_tokens=2048)
    reqs = _workload(llm, 16)
    assert [len(p) for p, _ in reqs[:10]] == [2, 507, 7, 10, 14, 9, 187, 10, 8, 6]
    alone = [_run(llm, [r])[0] for r in reqs]
    _check(hf, reqs, alone)
    together = _run(llm, reqs)
    assert together == alone


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_under_a_tiny_pool(model, caching) -> None:  # noqa: ANN001
    hf, folder = model
    llm = LLM(str(folder), num_blocks=40, block_size=16, enable_prefix_caching=caching)
    reqs = _workload(llm, 16)
    got = _run(llm, reqs)
    assert llm.engine.stats().num_preemptions > 0
    _check(hf, reqs, got)


def test_chunked_prefill_small_budget(model) -> None:  # noqa: ANN001
    hf, folder = model
    llm = LLM(str(folder), num_blocks=256, max_num_batched_tokens=32, max_num_seqs=8)
    reqs = _workload(llm, 16)
    got = _run(llm, reqs)
    _check(hf, reqs, got)


def test_prefix_cache_hits(model) -> None:  # noqa: ANN001
    hf, folder = model
    llm = LLM(str(folder), num_blocks=128, block_size=8, max_num_batched_tokens=64)
    reqs = shared_prefix_requests(8, seed=3)
    first = _run(llm, reqs[:1])  # warm the cache with the shared prefix
    rest = _run(llm, reqs[1:])
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    _check(hf, reqs, first + rest)
    again = _run(llm, reqs)  # everything cached now (except each last token)
    assert again == first + rest


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_slow_64_random_requests_every_mode(arch, hf_model_dir) -> None:  # noqa: ANN001
    hf = hf_model_dir(arch)
    folder = exported(hf)
    reqs = random_requests(64, seed=7, max_prompt=300, max_gen=48) + shared_prefix_requests(16, seed=8)
    configs = [dict(num_blocks=512), dict(num_blocks=40, max_num_batched_tokens=32, block_size=16),
               dict(num_blocks=64, block_size=8, max_num_seqs=5), dict(num_blocks=512, max_num_batched_tokens=7)]
    for cfg in configs:
        llm = LLM(str(folder), **cfg)
        _check(hf, reqs, _run(llm, reqs))
