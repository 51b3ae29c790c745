"""Sampler vs independent references: transformers' logits processors/warpers for penalties and the
top_k / top_p / min_p filtered distributions; plus seeds, logit_bias, min_tokens and logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from octavo.runtime.request import Request
from octavo.runtime.sampler import Sampler, log_softmax
from octavo.runtime.sampling_params import SamplingParams

V = 50
EOS = 2


def req(seed: int | None = 0, prompt: list[int] | None = None, out: list[int] | None = None, **kw) -> Request:
    p = SamplingParams(seed=seed, **kw)
    return Request(request_id="r", prompt_token_ids=prompt or [3, 4], params=p,
                   generator=np.random.default_rng(seed if seed is not None else 0), max_tokens=100, arrival_order=0,
                   output_token_ids=list(out or []))


def logits_rows(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, V)) * 3).astype(np.float32)


def distribution(logits: np.ndarray, reqs: list[Request]) -> np.ndarray:
    """The full [N, vocab] sampling distribution Sampler.candidates keeps (what the sampler draws from)."""
    probs = np.zeros(logits.shape, np.float64)
    for i, r in enumerate(reqs):
        ids, w = Sampler.candidates(logits[i], r)
        probs[i, ids] = w / w.sum(dtype=np.float64)
    return probs


def test_greedy_is_argmax() -> None:
    lg = logits_rows(4)
    out = Sampler([EOS])(lg, [req(temperature=0.0) for _ in range(4)])
    assert out.token_ids == [int(t) for t in np.argmax(lg, axis=-1)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), temperature=st.floats(0.2, 2.0), top_k=st.sampled_from([0, 1, 3, 10, 49]),
       top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.05, 0.3]))
def test_filtered_distribution_matches_transformers(seed, temperature, top_k, top_p, min_p) -> None:  # noqa: ANN001
    lg = logits_rows(1, seed)
    r = req(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = distribution(lg.copy(), [r])[0]
    probs = probs / probs.sum()
    x = torch.tensor(lg, dtype=torch.float64)
    ids = torch.zeros((1, 1), dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p:
        x = MinPLogitsWarper(min_p)(ids, x)
    ref = torch.softmax(x, dim=-1)[0].numpy()
    np.testing.assert_array_equal(probs > 0, ref > 0)  # the same support
    np.testing.assert_allclose(probs, ref, atol=1e-6)


def test_sampling_frequencies_follow_the_distribution() -> None:
    lg = np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)], np.float32))
    s = Sampler([EOS])
    r = req(seed=123, temperature=1.0, top_k=3)
    counts = np.bincount([s(lg, [r]).token_ids[0] for _ in range(4000)], minlength=V)
    assert counts[3:].sum() == 0  # outside top_k: never
    freq = counts[:3] / 4000
    np.testing.assert_allclose(freq, np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.03)


def test_repetition_penalty_matches_transformers() -> None:
    lg = logits_rows(1, 5)
    prompt, out = [1, 7, 9], [7, 11, 30]
    r = req(prompt=prompt, out=out, repetition_penalty=1.7, temperature=0.0)
    mine = lg.copy()
    Sampler._apply_penalties(mine, [r])
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + out]), torch.tensor(lg))
    np.testing.assert_allclose(mine, ref.numpy(), rtol=1e-6)


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    lg = logits_rows(1, 6)
    r = req(prompt=[4, 4, 5], out=[5, 5, 8], presence_penalty=0.5, frequency_penalty=0.25, temperature=0.0)
    mine = lg.copy()
    Sampler._apply_penalties(mine, [r])
    ref = lg.copy()
    ref[0, 5] -= 0.5 + 0.25 * 2
    ref[0, 8] -= 0.5 + 0.25 * 1
    np.testing.assert_allclose(mine, ref, rtol=1e-6)  # prompt-only token 4 untouched


def test_logit_bias_and_min_tokens() -> None:
    lg = logits_rows(2, 7)
    lg[:, EOS] = 50.0  # EOS would win
    s = Sampler([EOS])
    a = req(temperature=0.0, logit_bias={17: 100.0}, max_tokens=10)
    b = req(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[int(np.argsort(lg[1])[-2])])
    out = s(lg, [a, b])
    assert out.token_ids[0] == 17
    assert out.token_ids[1] not in (EOS, b.params.stop_token_ids[0])
    b.output_token_ids += [0, 0, 0]  # min_tokens reached: EOS allowed again
    assert s(lg, [a, b]).token_ids[1] == EOS


def test_logprobs_are_top_k_of_the_log_softmax_plus_the_chosen_token() -> None:
    lg = logits_rows(2, 8)
    r0 = req(seed=1, temperature=1.0, logprobs=3)
    r1 = req(temperature=0.0, logprobs=0)
    out = Sampler([EOS])(lg, [r0, r1])
    ref = log_softmax(lg.astype(np.float64))
    top = list(np.argsort(-ref[0])[:3])
    assert list(out.logprobs[0])[:3] == top
    assert out.token_ids[0] in out.logprobs[0]
    for t, v in out.logprobs[0].items():
        assert v == pytest.approx(ref[0, t], abs=1e-5)
    assert out.logprobs[1] == {out.token_ids[1]: pytest.approx(ref[1].max(), abs=1e-5)}


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    s = Sampler([EOS])
    steps = [logits_rows(5, 100 + i) for i in range(30)]

    alone = []
    target = req(seed=42, temperature=0.9, top_p=0.9)
    for lg in steps:
        alone.append(s(lg[2:3], [target]).token_ids[0])
    batch = [req(seed=1, temperature=1.0), req(seed=None, temperature=0.0), req(seed=42, temperature=0.9, top_p=0.9),
             req(seed=7, temperature=0.5, top_k=5), req(seed=42, temperature=1.3)]
    together = [s(lg, batch).token_ids[2] for lg in steps]
    assert together == alone
    other = req(seed=43, temperature=0.9, top_p=0.9)
    assert [s(lg[2:3], [other]).token_ids[0] for lg in steps] != alone


EXTREME_PENALTIES = [1e30, 1e38, 1e300, 1.7976931348623157e308, 5e-324, 1e-30, 1e-45]


def _exact_penalised(lg: np.ndarray, seen: set[int], penalty: float) -> list:  # noqa: ANN401
    """Independent reference in exact rational arithmetic (no floats, so nothing can overflow)."""
    from fractions import Fraction

    rp = Fraction(penalty)
    return [(Fraction(float(x)) / rp if x > 0 else Fraction(float(x)) * rp) if t in seen else Fraction(float(x))
            for t, x in enumerate(lg)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), penalty=st.sampled_from(EXTREME_PENALTIES),
       temperature=st.sampled_from([0.0, 1e-5, 0.7, 2.0]), all_seen=st.booleans())
def test_extreme_repetition_penalty_is_warning_free_and_keeps_the_order(seed, penalty, temperature,  # noqa: ANN001
                                                                         all_seen) -> None:
    """Fuzzed penalties (1e30, 5e-324, ...) emit no numpy warning (every warning is an error here), greedy
    picks the token the exact arithmetic picks (also when every token is penalised, so only the order
    among penalised tokens decides), and the sampled distribution is the exact one: at these penalties
    all mass sits on the winner (when the winner is penalised) or on the unpenalised tokens."""
    import warnings

    rng = np.random.default_rng(seed)
    lg = (rng.standard_normal(V) * 3).astype(np.float32)
    lg[rng.integers(0, V, 3)] *= 1000  # a few large logits, where multiplying by the penalty overflows float32
    prompt = list(range(V)) if all_seen else [int(t) for t in rng.choice(V, 10, replace=False)]
    exact = _exact_penalised(lg, set(prompt), penalty)
    want = max(range(V), key=lambda t: exact[t])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = req(prompt=prompt, repetition_penalty=penalty, temperature=temperature, logprobs=2)
        out = Sampler([EOS])(lg[None].copy(), [r])
        processed = lg[None].copy()
        Sampler._apply_penalties(processed, [r])
        probs = distribution(processed, [r])[0] if temperature else None  # after the penalty, as __call__
    assert np.isfinite(processed).all()
    assert all(np.isfinite(v) for v in out.logprobs[0].values())
    if temperature == 0.0:
        assert out.token_ids[0] == want
        assert out.logprobs[0][want] == max(out.logprobs[0].values())  # (near-ties at float32 precision may share it)
        return
    # exact distribution: p_t = exp((e_t - e_max) / T) / sum; terms below e^-800 are 0 in float64 anyway
    top = exact[want]
    expo = [float(max(e - top, -800 * temperature)) / temperature for e in exact]
    ref = np.exp(np.array(expo))
    ref /= ref.sum()
    np.testing.assert_allclose(probs / probs.sum(), ref, atol=1e-6)


@pytest.mark.parametrize("temperature", [1e30, 1e300, float(np.finfo(np.float64).max)])
def test_huge_temperature_is_uniform_and_warning_free(temperature: float) -> None:
    """Any finite temperature is accepted (as vLLM does); past ~1e30 the distribution is uniform, and
    computing it must not overflow the float32 divisor (which made every logit 0 / inf = NaN-prone)."""
    import warnings

    lg = logits_rows(1, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, w = Sampler.candidates(lg[0], req(temperature=temperature))
    assert len(ids) == V and np.isfinite(w).all()
    np.testing.assert_allclose(w / w.sum(), np.full(V, 1.0 / V), rtol=1e-6)
