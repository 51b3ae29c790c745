"""Beam search (vLLM's semantics) on the paged KV cache: the same beams as transformers' num_beams search and
as a plain re-implementation over transformers' logits (full forward passes, no cache), with the beams
sharing blocks by reference count, copy on write of the partial last block, and nothing leaked."""
from __future__ import annotations

import math

import numpy as np
import pytest
from engine_helpers import exported

from octavo import LLM, BeamSearchParams, SamplingParams
from octavo.runtime.beam_search import beam_score
from pool_check import check_pool

BLOCK = 16


@pytest.fixture(scope="module")
def llm(hf_dir):  # noqa: ANN001, ANN201
    llm = LLM(str(exported(hf_dir)), num_blocks=256, block_size=BLOCK, num_threads=1)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf(hf_dir):  # noqa: ANN001, ANN201
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    return model


_HF_CACHE: dict[tuple[int, ...], np.ndarray] = {}


def hf_logprobs(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """log-softmax of the next-token logits after IDS, by transformers (full forward, float64 softmax)."""
    import torch

    key = tuple(ids)
    if key not in _HF_CACHE:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        _HF_CACHE[key] = torch.log_softmax(logits, -1).numpy()
    return _HF_CACHE[key]


def reference_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: int,  # noqa: ANN001
                          ignore_eos: bool, length_penalty: float) -> list[tuple[list[int], float, str]]:
    """vLLM's beam search, written out plainly over transformers' logits: per step every beam proposes its
    top 2 x width tokens; EOS candidates are finished hypotheses, the best `width` others live on; at the end
    finished + live ranked by cumulative logprob / length ** length_penalty (length with the prompt, without
    a final EOS)."""
    live = [(list(prompt), 0.0)]
    done: list[tuple[list[int], float, str]] = []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in live:
            lp = hf_logprobs(model, toks)
            for t in np.argsort(-lp, kind="stable")[:2 * width]:
                t = int(t)
                if t == eos and not ignore_eos:
                    done.append((toks + [t], cum + lp[t], "stop"))
                else:
                    cands.append((toks + [t], cum + lp[t]))
        cands.sort(key=lambda c: -c[1])
        live = cands[:width]
        if not live:
            break
    pool = done + [(t, c, "length") for t, c in live]
    pool.sort(key=lambda s: -beam_score(len(s[0]), s[1], s[2] == "stop", length_penalty))
    return pool[:width]


# ------------------------------------------------------------------------------------------------
# the beams


def test_equals_transformers_num_beams_without_eos(llm, hf) -> None:  # noqa: ANN001
    """No EOS in play: vLLM's and transformers' beam searches are the same search (the best `width` of all
    beam x token extensions each step); every hypothesis runs max_tokens, so the length penalty cannot
    reorder them. transformers' length_penalty=0 makes its sequence score the cumulative logprob."""
    import torch
    from transformers import GenerationConfig

    prompt = [5, 17, 99, 3, 42, 250, 7, 8, 120, 33, 64, 11, 200, 19, 23, 77, 150, 9, 31]  # 19: a partial block
    for width, max_tokens in ((2, 6), (4, 9)):
        got = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
        cfg = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                               length_penalty=0.0, early_stopping=True, eos_token_id=None,
                               pad_token_id=0, bos_token_id=None, output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), generation_config=cfg)
        seqs = got[0].sequences
        assert [s.tokens for s in seqs] == ref.sequences.tolist()
        np.testing.assert_allclose([s.cum_logprob for s in seqs], ref.sequences_scores.tolist(), atol=2e-3)
        assert all(s.finish_reason == "length" and s.output_token_ids == s.tokens[len(prompt):] for s in seqs)


def _prompt_with_eos(hf, llm, width: int, steps: int) -> list[int]:  # noqa: ANN001
    """A random prompt whose beam search meets EOS among its candidates (so finished hypotheses matter)."""
    eos = llm.get_tokenizer().eos_token_ids[0]
    rng = np.random.default_rng(7)
    for _ in range(60):
        prompt = [int(t) for t in rng.integers(5, 380, size=int(rng.integers(3, 40)))]
        ref = reference_beam_search(hf, prompt, width, steps, eos, False, 1.0)
        if any(r[2] == "stop" for r in ref):
            return prompt
    pytest.skip("no random prompt met EOS in its beams")


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_equals_reference_with_eos_and_length_penalty(llm, hf, length_penalty: float) -> None:  # noqa: ANN001
    width, steps = 3, 8
    eos = llm.get_tokenizer().eos_token_ids[0]
    prompt = _prompt_with_eos(hf, llm, width, steps)
    want = reference_beam_search(hf, prompt, width, steps, eos, False, length_penalty)
    got = llm.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=steps,
                                                   length_penalty=length_penalty))[0].sequences
    assert [(s.tokens, s.finish_reason) for s in got] == [(t, r) for t, _, r in want]
    np.testing.assert_allclose([s.cum_logprob for s in got], [c for _, c, _ in want], atol=2e-3)
    tok = llm.get_tokenizer()
    assert all(s.text == tok.decode(s.tokens) for s in got)


def test_generate_with_use_beam_search_returns_the_n_best(llm) -> None:  # noqa: ANN001
    prompt = "The quick brown fox"
    best = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=7, ignore_eos=True))[0].sequences
    out = llm.generate(prompt, SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=7, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [s.output_token_ids for s in best[:2]]
    assert [o.index for o in out.outputs] == [0, 1] and out.finished
    tok = llm.get_tokenizer()
    assert [o.text for o in out.outputs] == [tok.decode(s.output_token_ids) for s in best[:2]]


def test_batched_with_other_requests_and_under_preemption(hf_dir, llm) -> None:  # noqa: ANN001
    """Searches and sampled requests in one batch, in a pool so small that beams are preempted and
    recomputed: the same beams as alone in a large pool, and nothing leaked."""
    prompts = [[5 + i, 40, 90 + i, 7, 3, 200 - i, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27 + i] for i in range(3)]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    want = [o.sequences for o in llm.beam_search(prompts, params)]
    small = LLM(str(exported(hf_dir)), num_blocks=10, block_size=BLOCK, num_threads=1, max_num_seqs=6)
    try:
        mixed = small.generate(
            [*prompts, "Hello world"],
            [*(SamplingParams(n=3, use_beam_search=True, max_tokens=10, ignore_eos=True) for _ in prompts),
             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)], use_tqdm=False)
        assert small.engine.stats().num_preemptions > 0  # the pool really was too small for everyone at once
        for out, seqs in zip(mixed[:3], want):
            assert [o.token_ids for o in out.outputs] == [s.output_token_ids for s in seqs]
        alone = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                             use_tqdm=False)[0]
        assert mixed[3].outputs[0].token_ids == alone.outputs[0].token_ids
        assert small.engine.block_manager.num_free_blocks == 10
    finally:
        small.close()


def _near_tie(model, prompt: list[int], width: int, steps: int) -> bool:  # noqa: ANN001
    """Does the no-EOS search meet a choice between candidates closer than float noise between ONNX Runtime
    and torch could decide (the width-th and next best within 1e-3)? Such draws are not comparable."""
    live = [(list(prompt), 0.0)]
    for _ in range(steps):
        cands = sorted(((toks + [int(t)], cum + lp[t]) for toks, cum in live
                        for lp in [hf_logprobs(model, toks)] for t in np.argsort(-lp)[:2 * width + 1]),
                       key=lambda c: -c[1])
        if len(cands) > width and cands[width - 1][1] - cands[width][1] < 1e-3:
            return True
        live = cands[:width]
    return False


def test_random_searches_equal_the_reference(hf_dir, hf) -> None:  # noqa: ANN001
    """Property: random prompts, widths, lengths, penalties and pool sizes (small pools preempt and recompute
    beams; block size 4 makes many partial-block forks): the engine's beams == the reference's."""
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    engines: dict[int, LLM] = {}

    def engine(num_blocks: int) -> LLM:
        if num_blocks not in engines:
            engines[num_blocks] = LLM(str(exported(hf_dir)), num_blocks=num_blocks, block_size=4, num_threads=1,
                                      max_num_seqs=8)
        return engines[num_blocks]

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(prompt=st.lists(st.integers(5, 380), min_size=1, max_size=30), width=st.integers(1, 4),
           steps=st.integers(1, 7), length_penalty=st.sampled_from([0.0, 1.0, 2.0]),
           num_blocks=st.sampled_from([24, 200]))
    def check(prompt: list[int], width: int, steps: int, length_penalty: float, num_blocks: int) -> None:
        assume(not _near_tie(hf, prompt, width, steps))
        llm = engine(num_blocks)
        assume(len(prompt) + steps <= 4 * num_blocks)
        eos = llm.get_tokenizer().eos_token_ids[0]
        want = reference_beam_search(hf, prompt, width, steps, eos, True, length_penalty)
        got = llm.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True,
                                                       length_penalty=length_penalty))[0].sequences
        assert [s.tokens for s in got] == [t for t, _, _ in want]
        assert llm.engine.block_manager.num_free_blocks == num_blocks

    try:
        check()
    finally:
        for e in engines.values():
            e.close()


# ------------------------------------------------------------------------------------------------
# the blocks


class CountingCopies:
    """Wraps the engine's backend: counts copy_blocks calls and the pairs copied."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.pairs: list[tuple[int, int]] = []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.pairs += pairs
        self.inner(pairs)


def test_beams_share_blocks_by_refcount_copy_only_the_partial_block_and_leak_nothing(llm, hf) -> None:  # noqa: ANN001
    engine = llm.engine
    bm = engine.block_manager
    copies = CountingCopies(engine.beams.copy_blocks)
    engine.beams.copy_blocks = copies.copy_blocks
    free0 = bm.num_free_blocks
    prompt = list(range(40, 77))  # 37 tokens: blocks 0, 1 full, block 2 holds 5
    width = 4
    try:
        engine.add_request("beams", prompt, SamplingParams(n=width, use_beam_search=True, max_tokens=12,
                                                           ignore_eos=True))
        seen_sharing = False
        final = None
        while final is None:
            for out in engine.step():
                if out.request_id == "beams" and out.finished:
                    final = out
            live = engine.beams.searches["beams"].beams.live if engine.beams.has("beams") else []
            check_pool(bm, [r.block_table for r in engine.scheduler.running])  # refcounts == references
            if len(live) == width and all(r.num_computed_tokens >= len(prompt) for r in live):
                seen_sharing = True
                for b in live[0].block_table[:2]:  # the prompt's full blocks: one copy, read by every beam
                    assert all(r.block_table[:2] == live[0].block_table[:2] for r in live)
                    assert bm.ref_count[b] == width
                # a beam's partially filled last block is its own (copied on the fork): it writes there next
                lasts = [r.block_table[-1] for r in live if r.num_computed_tokens % BLOCK]
                assert len(set(lasts)) == len(lasts) and all(bm.ref_count[b] == 1 for b in lasts)
                held = {b for r in live for b in r.block_table}
                assert len(held) < sum(len(r.block_table) for r in live)  # shared, not one copy per beam
        assert seen_sharing
        assert copies.pairs, "the beams diverged inside a partial block: it must have been copied"
        assert bm.num_free_blocks == free0 and not engine.scheduler.running  # nothing leaked
        # the copies made the result exact: the same beams as the reference over transformers
        eos = llm.get_tokenizer().eos_token_ids[0]
        want = reference_beam_search(hf, prompt, width, 12, eos, True, 1.0)
        assert [o.token_ids for o in final.outputs] == [t[len(prompt):] for t, _, _ in want]
        for o, (_, c, _) in zip(final.outputs, want):
            assert math.isclose(o.cumulative_logprob, c, abs_tol=2e-3)
    finally:
        engine.beams.copy_blocks = copies.inner


def test_abort_mid_search_frees_every_beam(llm) -> None:  # noqa: ANN001
    engine = llm.engine
    free0 = engine.block_manager.num_free_blocks
    engine.add_request("gone", list(range(60, 100)), SamplingParams(n=3, use_beam_search=True, max_tokens=50,
                                                                     ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert len(engine.beams.searches["gone"].beams.live) == 3
    engine.abort_request("gone")
    outs = engine.step()
    assert [o.finished and o.outputs[0].finish_reason for o in outs if o.request_id == "gone"] == ["abort"]
    assert engine.block_manager.num_free_blocks == free0 and not engine.has_request("gone")


def test_refusals(llm) -> None:  # noqa: ANN001
    from octavo.errors import InvalidRequestError

    for bad in (dict(stop=["x"]), dict(logprobs=2), dict(stop_token_ids=[3]), dict(best_of=1, n=2)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(use_beam_search=True, **bad)
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=1, best_of=3)  # without beam search
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)


def test_a_backend_without_block_copies_refuses_beam_search_clearly(tmp_path) -> None:  # noqa: ANN001
    """The TensorRT backend (and any backend without copy_blocks) cannot copy a partial block: beam search is
    refused when the request is made, with the reason; other requests run."""
    from toy_backend import ToyBackend, make_toy_model_dir

    from octavo.errors import InvalidRequestError

    toy = LLM(str(make_toy_model_dir(tmp_path / "toy")), block_size=4, backend_instance=ToyBackend(24, 4))
    try:
        with pytest.raises(InvalidRequestError, match="copy KV blocks.*onnxruntime"):
            toy.generate([1, 2, 3], SamplingParams(n=2, use_beam_search=True, max_tokens=3), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="copy KV blocks"):
            toy.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3))
        assert toy.generate([1, 2, 3], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        toy.close()
