"""Cold shared prefixes on the real exported model: requests that arrive together with one long
prefix compute it once (the others are held until its blocks are cached), and every output still
equals HF transformers' greedy continuation — with chunked prefill, an aborted or preempted
producer, and n > 1."""
from __future__ import annotations

import random

import pytest
from engine_helpers import exported, greedy, hf_reference

from octavo import LLM, SamplingParams
from octavo.runtime.engine import LLMEngine
from octavo.runtime.engine_args import EngineArgs

PREFIX_LEN = 48  # 6 blocks of 8


@pytest.fixture(scope="module")
def model(hf_model_dir):  # noqa: ANN001, ANN201
    hf = hf_model_dir("llama")
    return hf, exported(hf)


def shared(n: int, seed: int, prefix_len: int = PREFIX_LEN) -> list[tuple[list[int], int]]:
    """n prompts: one random prefix, then a suffix of 1..10 tokens whose first token is the request's own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 300) for _ in range(prefix_len)]
    return [(prefix + [300 + i] + [rng.randrange(5, 384) for _ in range(rng.randrange(0, 10))], rng.randrange(3, 9))
            for i in range(n)]


def run_all(eng: LLMEngine) -> dict[str, object]:
    outs = {}
    while eng.has_unfinished_requests():
        outs |= {o.request_id: o for o in eng.step()}
    assert eng.block_manager.promised == {} and eng.stats().num_free_blocks == eng.stats().num_total_blocks
    return outs


def check_hf(hf, reqs, outs) -> None:  # noqa: ANN001
    for i, (p, m) in enumerate(reqs):
        assert outs[str(i)].outputs[0].token_ids == hf_reference(hf, p, m), f"request {i} differs from HF"


@pytest.mark.parametrize("budget", [2048, 20])  # 20: the producer's prefill takes 3 chunks, the last one
# finishes the prefix's last block with budget to spare (with 16, nobody is even looked at before the
# prefix is cached)
def test_eight_requests_arriving_together_compute_the_prefix_once(model, budget) -> None:  # noqa: ANN001
    hf, folder = model
    reqs = shared(8, seed=1)
    llm = LLM(str(folder), num_blocks=128, block_size=8, max_num_batched_tokens=budget)
    rows: list[dict] = []
    llm.engine.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [greedy(m) for _, m in reqs], use_tqdm=False)
    stats = llm.engine.stats()
    suffixes = sum(len(p) - PREFIX_LEN for p, _ in reqs)
    assert stats.prompt_tokens_total == PREFIX_LEN + suffixes  # (without holding: 8 * 48 + suffixes)
    assert stats.prefix_cache_hits == 7 * PREFIX_LEN
    assert [o.num_cached_tokens for o in outs] == [0] + [PREFIX_LEN] * 7
    held = {rid for r in rows for rid in r["held"]}
    assert held == {o.request_id for o in outs[1:]}
    check_hf(hf, reqs, {str(i): o for i, o in enumerate(outs)})


def test_an_aborted_producer_hands_over_mid_prefix(model) -> None:  # noqa: ANN001
    hf, folder = model
    reqs = shared(8, seed=2)
    eng = LLMEngine(EngineArgs(model=str(folder), num_blocks=128, block_size=8, max_num_batched_tokens=36))
    rows: list[dict] = []
    eng.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    for i, (p, m) in enumerate(reqs):
        eng.add_request(str(i), p, greedy(m))
    eng.step()  # the producer computed 36 of the 48 prefix tokens (4 full blocks and half of one); nobody else ran
    assert eng.stats().prompt_tokens_total == 36
    eng.abort_request("0")
    outs = run_all(eng)
    assert outs["0"].outputs[0].finish_reason == "abort"
    # request 1 takes over from the 4 blocks the aborted producer filled (only its 4 tokens of block 4
    # are lost) and finishes its prompt with budget to spare: the others wait for it this time
    assert eng.stats().prompt_tokens_total == 36 + (PREFIX_LEN - 32) + sum(len(p) - PREFIX_LEN for p, _ in reqs[1:])
    assert outs["1"].num_cached_tokens == 32 and all(outs[str(i)].num_cached_tokens == PREFIX_LEN for i in range(2, 8))
    assert {rid for r in rows for rid in r["held"]} == {str(i) for i in range(2, 8)}
    check_hf(hf, reqs[1:], {str(i - 1): outs[str(i)] for i in range(1, 8)})


def test_a_producer_preempted_mid_prefix(model) -> None:  # noqa: ANN001
    """A tiny pool: r, admitted first, grows until the producer a (halfway through the prefix) is
    preempted; everyone still matches HF and b, c still get the whole prefix from the cache."""
    hf, folder = model
    eng = LLMEngine(EngineArgs(model=str(folder), num_blocks=6, block_size=4, max_num_batched_tokens=8))
    rows: list[dict] = []
    eng.add_step_listener(lambda rec: rows.append(rec.trace_row()))
    prefix = list(range(200, 216))
    reqs = {"r": (list(range(20, 28)), 12)} | {x: (prefix + [30 + i, 40 + i], 4) for i, x in enumerate("abc")}
    eng.add_request("r", *reqs["r"][:1], greedy(12))
    eng.step()
    for x in "abc":
        eng.add_request(x, reqs[x][0], greedy(4))
    outs = run_all(eng)
    a_len = {r["step"]: q["total_len"] for r in rows for q in r["requests"] if q["id"] == "a"}
    preempted = [r["step"] for r in rows if "a" in r["preempted"]]
    assert preempted and a_len[preempted[0] - 1] < 16, "the producer was not preempted mid-prefix"
    assert outs["b"].num_cached_tokens == outs["c"].num_cached_tokens == 16
    for rid, (p, m) in reqs.items():
        assert outs[rid].outputs[0].token_ids == hf_reference(hf, p, m), rid


def test_n_completions_among_requests_sharing_a_cold_prefix(model) -> None:  # noqa: ANN001
    hf, folder = model
    reqs = shared(5, seed=3)
    llm = LLM(str(folder), num_blocks=128, block_size=8)
    params = [SamplingParams(n=3, temperature=0.0, max_tokens=m, ignore_eos=True) if i == 1 else greedy(m)
              for i, (_, m) in enumerate(reqs)]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    for i, ((p, m), o) in enumerate(zip(reqs, outs)):
        ref = hf_reference(hf, p, m)
        assert [c.token_ids for c in o.outputs] == [ref] * (3 if i == 1 else 1), f"request {i}"
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 4 * PREFIX_LEN and stats.num_free_blocks == 128
    # the prefix once, each prompt's own tokens once, and children 2-3 of request 1 only its last partial block
    own = sum(len(p) - PREFIX_LEN for p, _ in reqs)
    assert stats.prompt_tokens_total == PREFIX_LEN + own + 2 * (len(reqs[1][0]) - (len(reqs[1][0]) - 1) // 8 * 8)
