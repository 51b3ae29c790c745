"""SamplingParams(prompt_logprobs=k) through the engine, against transformers' log_softmax of the full-sequence
logits of the same checkpoint: the prompt split into several prefill chunks, its first blocks already in the
prefix cache, batched with ordinary generation requests (whose greedy tokens must stay transformers'), and
under preemption."""
from __future__ import annotations

import random

import numpy as np
import pytest
from engine_helpers import exported, greedy, hf_prompt_logits, hf_reference

from octavo import LLM, SamplingParams
from octavo.errors import InvalidRequestError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs

TOL = 1e-4
K = 5


def _hf_log_softmax(src, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    import torch

    return torch.log_softmax(torch.from_numpy(hf_prompt_logits(src, ids)).double(), dim=-1).numpy()


def check_against_hf(prompt_logprobs, ids: list[int], ref: np.ndarray, k: int = K) -> None:  # noqa: ANN001
    """Every position: the prompt token's logprob and rank, and the top k, as transformers says."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None  # the first token has no context
    for p in range(1, len(ids)):
        entry, row, tok = prompt_logprobs[p], ref[p - 1], ids[p]
        assert tok in entry, p
        assert abs(entry[tok].logprob - row[tok]) < TOL, (p, entry[tok].logprob, row[tok])
        assert entry[tok].rank == int((row >= row[tok] - 1e-7).sum()) or abs(
            np.sort(row)[::-1][entry[tok].rank - 1] - row[tok]) < TOL, p  # rank (ties within fp noise aside)
        top = sorted((t for t in entry if t != tok or entry[t].rank <= k), key=lambda t: -entry[t].logprob)[:k]
        want = np.sort(row)[::-1][:k]
        np.testing.assert_allclose([entry[t].logprob for t in top], want, atol=TOL, rtol=0, err_msg=str(p))
        np.testing.assert_allclose([row[t] for t in top], want, atol=TOL, rtol=0, err_msg=str(p))
        assert all(entry[t].decoded is not None for t in entry)


def _engine(folder, **kw) -> LLMEngine:  # noqa: ANN001
    base = dict(model=str(folder), num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=40,
                enable_prefix_caching=True, num_threads=1)
    base.update(kw)
    return LLMEngine(EngineArgs(**base))


def _run(engine: LLMEngine) -> dict:
    """Step to the end; per request id: its last output, and the prompt_logprobs it carried (wherever they came)."""
    last, plp = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
            if out.prompt_logprobs is not None:
                plp[out.request_id] = out.prompt_logprobs
    return {"last": last, "plp": plp}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gemma2"])
def test_chunked_prefix_hit_and_batched_match_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    src = hf_model_dir(arch)
    folder = exported(src)
    rng = random.Random(7)
    prompt = [rng.randrange(5, 384) for _ in range(100)]  # 100 tokens: 3 chunks at 40 tokens per step
    other = [rng.randrange(5, 384) for _ in range(30)]
    shared = prompt[:48] + [rng.randrange(5, 384) for _ in range(20)]  # shares 3 full blocks with the prompt
    engine = _engine(folder)
    try:
        engine.add_request("warm", prompt[:64] + [7, 8, 9], greedy(1))  # puts the prompt's first 4 blocks in the cache
        _run(engine)
        engine.add_request("scored", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                            prompt_logprobs=K))
        engine.add_request("shared", shared, greedy(6))
        engine.add_request("other", other, greedy(6))
        got = _run(engine)
    finally:
        engine.close()
    check_against_hf(got["plp"]["scored"], prompt, _hf_log_softmax(src, prompt))
    last = got["last"]
    # the scored request's own tokens, and the requests batched beside it, are what transformers generates
    assert list(last["scored"].outputs[0].token_ids) == hf_reference(src, prompt, 4)
    assert list(last["shared"].outputs[0].token_ids) == hf_reference(src, shared, 6)
    assert list(last["other"].outputs[0].token_ids) == hf_reference(src, other, 6)
    assert "shared" not in got["plp"] and "other" not in got["plp"]
    # the cache served the ordinary request; the scored one computed every position it was asked about
    assert last["shared"].num_cached_tokens == 48
    assert last["scored"].num_cached_tokens == 0


def test_preempted_mid_prompt_still_exact(hf_model_dir) -> None:  # noqa: ANN001
    """A pool too small for both: the later request is preempted (its blocks freed) and recomputed; the
    rows scored before the preemption are kept, the recomputed positions are not scored twice."""
    src = hf_model_dir("llama")
    rng = random.Random(3)
    a = [rng.randrange(5, 384) for _ in range(90)]
    b = [rng.randrange(5, 384) for _ in range(90)]
    engine = _engine(exported(src), num_blocks=10, max_num_batched_tokens=32, enable_prefix_caching=False)
    try:
        engine.add_request("a", a, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2))
        engine.add_request("b", b, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2))
        got = _run(engine)
        assert engine.stats().num_preemptions > 0
    finally:
        engine.close()
    for rid, ids in (("a", a), ("b", b)):
        check_against_hf(got["plp"][rid], ids, _hf_log_softmax(src, ids), k=2)
        assert list(got["last"][rid].outputs[0].token_ids) == hf_reference(src, ids, 40)


def test_llm_generate_n_and_short_prompts(hf_model_dir) -> None:  # noqa: ANN001
    src = hf_model_dir("qwen2")
    llm = LLM(str(exported(src)), num_blocks=64, num_threads=1, max_num_batched_tokens=24)
    try:
        prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 4, [42]]
        params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=3, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        plain = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        llm.close()
    assert [len(o.outputs) for o in outs] == [2, 2]
    check_against_hf(outs[0].prompt_logprobs, prompts[0], _hf_log_softmax(src, prompts[0]), k=0)
    assert all(len(e) == 1 for e in outs[0].prompt_logprobs[1:])  # k=0: only the prompt's own token
    assert outs[1].prompt_logprobs == [None]  # one token: nothing to score
    assert plain[0].prompt_logprobs is None  # not asked: not computed


@pytest.mark.parametrize("bad", [-2, 1.5, True, "3"])  # -1 (the vocabulary) and > 20: the engine's max_logprobs
def test_bad_prompt_logprobs_refused(bad) -> None:  # noqa: ANN001
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_output_kinds_and_a_request_that_ends_on_its_first_token(hf_model_dir, kind: str) -> None:  # noqa: ANN001
    """delta: the prompt logprobs come once, on the first output; cumulative: on every output. A request
    with max_tokens 1 (score only) ends in the step that completes its prompt and still carries them."""
    src = hf_model_dir("llama")
    ids = list(range(5, 47))
    engine = _engine(exported(src), max_num_batched_tokens=16)
    try:
        engine.add_request("long", ids, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1,
                                                       output_kind=kind))
        engine.add_request("one", ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1,
                                                      output_kind=kind))
        seen: dict[str, list] = {"long": [], "one": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out.prompt_logprobs)
    finally:
        engine.close()
    ref = _hf_log_softmax(src, ids)
    assert len(seen["one"]) == 1
    check_against_hf(seen["one"][0], ids, ref, k=1)
    assert len(seen["long"]) == 4
    if kind == "delta":
        assert seen["long"][0] is not None and seen["long"][1:] == [None] * 3
    else:
        assert all(p is seen["long"][0] for p in seen["long"])
    check_against_hf(seen["long"][0], ids, ref, k=1)


def test_rows_per_step_are_capped(hf_model_dir) -> None:  # noqa: ANN001
    """The scheduler shortens chunks so that one step never asks for more prompt-logprob rows than its cap
    (bounded logits memory; a TensorRT engine's max_num_logits); the result is unchanged."""
    src = hf_model_dir("llama")
    rng = random.Random(5)
    a, b = [rng.randrange(5, 384) for _ in range(60)], [rng.randrange(5, 384) for _ in range(45)]
    engine = _engine(exported(src), max_num_batched_tokens=64)
    engine.scheduler.max_prompt_logprob_rows = 7
    rows: list[int] = []
    score = engine.outputs.score_prompts

    def counting(plan, logits):  # noqa: ANN001, ANN202 - the real reduction, each step's rows noted
        rows.append(logits.shape[0])
        assert logits.shape[0] == sum(c for _, c in plan.values())
        return score(plan, logits)

    engine.outputs.score_prompts = counting
    try:
        engine.add_request("a", a, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))
        engine.add_request("b", b, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))
        engine.add_request("g", b[:20], greedy(8))
        got = _run(engine)
    finally:
        engine.close()
    assert max(rows) <= 7 and sum(r > 0 for r in rows) >= (59 + 44) // 7
    check_against_hf(got["plp"]["a"], a, _hf_log_softmax(src, a), k=3)
    check_against_hf(got["plp"]["b"], b, _hf_log_softmax(src, b), k=3)
    assert list(got["last"]["g"].outputs[0].token_ids) == hf_reference(src, b[:20], 8)
