"""Speculative decoding's parts against independent references: the config (vLLM's keys and defaults), the
n-gram proposer against a brute-force search, and the acceptance rule against the target's distribution
(a chi-square test on a small vocabulary with a fixed seed, against a numpy reference of the target)."""
from __future__ import annotations

import argparse
import random

import numpy as np
import pytest

from octavo.errors import InvalidRequestError
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.ngram_proposer import propose_ngram
from octavo.runtime.rejection_sampler import RejectionSampler
from octavo.runtime.request import Request
from octavo.runtime.sampler import Sampler
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.spec_decode import next_spec_limit
from octavo.runtime.speculative_config import SpeculativeConfig

# chi-square quantiles at 1 - 1e-4 (scipy.stats.chi2.ppf(0.9999, df)): a correct rule fails 1 run in 10,000
CHI2_9999 = {3: 21.11, 5: 25.74, 8: 31.83, 9: 33.72, 11: 37.37}


# -- config ------------------------------------------------------------------------------------------

def test_config_as_vllm() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min == 5
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    draft = SpeculativeConfig.parse({"model": "/models/draft", "num_speculative_tokens": 4})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/draft", 4)


@pytest.mark.parametrize("bad, words", [
    ("{not json", "JSON object"),
    ('["ngram"]', "JSON object"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "go together"),
    ({"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 2}, "go together"),
    ({"model": "", "num_speculative_tokens": 2}, "path"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown key"),
])
def test_config_refusals_name_the_problem(bad, words: str) -> None:  # noqa: ANN001
    with pytest.raises(InvalidRequestError, match=words):
        SpeculativeConfig.parse(bad)
    with pytest.raises(InvalidRequestError, match=words):  # EngineArgs checks it before loading anything
        EngineArgs(model="unused", speculative_config=bad).validate()


def test_the_flag_is_vllms() -> None:
    from octavo.commands.engine_flags import add_engine_arguments, engine_args

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_arguments(parser)
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    args = engine_args(parser.parse_args(["m", "--speculative-config", text]))
    assert SpeculativeConfig.parse(args.speculative_config).prompt_lookup_min == 2


def test_adaptive_length() -> None:
    assert next_spec_limit(4, 4, 4, 6) == 5 and next_spec_limit(6, 6, 6, 6) == 6  # all accepted: one more
    assert next_spec_limit(4, 4, 0, 6) == 2 and next_spec_limit(1, 1, 0, 6) == 1  # none: half, at least 1
    assert next_spec_limit(4, 4, 2, 6) == 4


# -- n-gram proposer ---------------------------------------------------------------------------------

def _reference_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Brute force: for n from HI down to LO, the earliest earlier occurrence of the last n tokens."""
    for n in range(hi, lo - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_equals_brute_force() -> None:
    rng = random.Random(0)
    checked = found = 0
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        lo = rng.randrange(1, 5)
        hi = rng.randrange(lo, 7)
        k = rng.randrange(1, 6)
        want = _reference_ngram(toks, lo, hi, k)
        assert propose_ngram(np.asarray(toks, np.int64), lo, hi, k) == want, (toks, lo, hi, k)
        checked += 1
        found += bool(want)
    assert found > checked // 3  # the cases exercise matches, not only misses


# -- the acceptance rule -----------------------------------------------------------------------------

V = 6


def _request(params: SamplingParams, seed: int, drafts: list[int]) -> Request:
    req = Request("r", [1, 2, 3], params, np.random.default_rng(seed), max_tokens=100, arrival_order=0)
    req.output_token_ids = [4]
    req.spec_token_ids = list(drafts)
    return req


def _target(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """numpy reference of what the target samples from: softmax of logits / temperature over the top_k."""
    x = logits / temperature
    keep = np.argsort(-x)[:top_k]
    p = np.zeros_like(x, dtype=np.float64)
    p[keep] = np.exp(x[keep] - x[keep].max())
    return p / p.sum()


def _chi2(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    assert set(counts) <= set(expected), f"impossible outcomes {set(counts) - set(expected)}"
    return sum((counts.get(c, 0) - n * e) ** 2 / (n * e) for c, e in expected.items())


def test_rejection_sampling_gives_the_targets_distribution() -> None:
    """Drafts d1, d2 over 3 logits rows: the emitted tokens (x) | (d1, y) | (d1, d2, z) must be distributed
    as the target alone: p0(x); p0(d1) p1(y); p0(d1) p1(d2) p2(z)."""
    rows = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5],
                     [0.0, 2.5, 1.0, 1.0, -0.5, 0.2],
                     [1.0, 1.2, 0.8, 0.0, -0.5, -3.0]], np.float32)
    params = SamplingParams(temperature=0.9, top_k=4, max_tokens=100)
    d1, d2 = 5, 2  # d1 is likely under row 0; d2 less so under row 1
    p = [_target(r, 0.9, 4) for r in rows]
    expected: dict[tuple, float] = {}
    for x in range(V):
        if x != d1 and p[0][x] > 0:
            expected[(x,)] = p[0][x]
    for y in range(V):
        if y != d2 and p[1][y] > 0:
            expected[(d1, y)] = p[0][d1] * p[1][y]
    for z in range(V):
        if p[2][z] > 0:
            expected[(d1, d2, z)] = p[0][d1] * p[1][d2] * p[2][z]
    assert abs(sum(expected.values()) - 1) < 1e-9 and len(expected) == 3 + 3 + 4
    sampler = RejectionSampler(Sampler([0]))
    req = _request(params, 7, [d1, d2])
    n = 8000
    counts: dict[tuple, int] = {}
    for _ in range(n):
        req.spec_token_ids = [d1, d2]
        toks = tuple(sampler(rows, [req]).token_ids[0])
        counts[toks] = counts.get(toks, 0) + 1
    assert _chi2(counts, expected, n) < CHI2_9999[len(expected) - 1]
    # ... and a wrong rule is caught: accepting every draft would give (d1, d2, z) far too often
    assert counts.get((d1, d2, 0), 0) < 0.5 * n


def test_greedy_acceptance_and_penalties_see_the_drafts() -> None:
    """Greedy: drafts are kept while they are each row's argmax; the processors of a draft row see the drafts
    before it as output (a repetition penalty on a draft changes the next row's argmax, as without speculation)."""
    rows = np.array([[0, 5, 1, 0, 0, 0], [0, 0, 4, 3.9, 0, 0], [0, 0, 0, 0, 2, 0]], np.float32)
    sampler = RejectionSampler(Sampler([0]))
    greedy = SamplingParams(temperature=0.0, max_tokens=100)
    assert sampler(rows, [_request(greedy, 0, [1, 2])]).token_ids == [[1, 2, 4]]
    assert sampler(rows, [_request(greedy, 0, [1, 3])]).token_ids == [[1, 2]]
    assert sampler(rows, [_request(greedy, 0, [2, 2])]).token_ids == [[1]]
    # a presence penalty of 0.5 on tokens already output: row 1 sees token 2 only if the draft before it was 2
    pen = SamplingParams(temperature=0.0, max_tokens=100, presence_penalty=0.5, logprobs=1)
    req = _request(pen, 0, [1, 2])
    req.output_token_ids = [2]  # token 2 already output: row 1's argmax becomes 3 (4 - 0.5 < 3.9)
    out = sampler(rows, [req])
    assert out.token_ids == [[1, 3]]
    plain = Sampler([0])(rows[1:2] - np.array([[0, 0.5, 0.5, 0, 0, 0]], np.float32), [_request(greedy, 0, [])])
    assert plain.token_ids == [3]
    assert [set(e) for e in out.logprobs[0]] == [{1}, {3}]  # one entry per emitted token, its own row's


def test_without_drafts_it_is_the_sampler() -> None:
    """A sampled request without drafts takes exactly the one draw it takes without speculation, also beside
    a request with drafts."""
    rows = np.random.default_rng(1).normal(size=(4, V)).astype(np.float32)
    params = SamplingParams(temperature=1.0, max_tokens=100, seed=3)
    alone = [Sampler([0])(rows[:1], [_request(params, s, [])]).token_ids[0] for s in range(50)]
    rs = RejectionSampler(Sampler([0]))
    beside = []
    for s in range(50):
        other = _request(SamplingParams(temperature=0.0, max_tokens=100), 0, [1, 2])
        beside.append(rs(np.concatenate([rows[1:], rows[:1]]), [other, _request(params, s, [])]).token_ids[1][0])
    assert beside == alone
