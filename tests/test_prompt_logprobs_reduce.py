"""reduce_logprob_rows against torch.log_softmax (an independent implementation), on awkward rows too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.runtime.prompt_logprobs import logprob_dicts, reduce_logprob_rows


def _torch_reference(logits: np.ndarray, targets: np.ndarray, k: int):
    lp = torch.log_softmax(torch.from_numpy(logits.astype(np.float32)), dim=-1)
    chosen = lp[torch.arange(lp.shape[0]), torch.from_numpy(targets)]
    ranks = (lp >= chosen[:, None]).sum(-1)
    top = torch.topk(lp, k, dim=-1) if k else None
    return lp.numpy(), chosen.numpy(), ranks.numpy(), top


@pytest.mark.parametrize("rows,vocab,k,per_pass", [(37, 500, 5, 8), (3, 49152, 20, 64), (10, 50, 0, 3),
                                                   (4, 6, 6, 64), (1, 1, 1, 1)])
def test_matches_torch_log_softmax(rows: int, vocab: int, k: int, per_pass: int) -> None:
    rng = np.random.default_rng(rows * vocab + k)
    logits = (rng.standard_normal((rows, vocab)) * 8).astype(np.float32)
    targets = rng.integers(0, vocab, rows)
    got = reduce_logprob_rows(logits, targets, k, rows_per_pass=per_pass)
    lp, chosen, ranks, top = _torch_reference(logits, targets, k)
    np.testing.assert_allclose(got.logprobs, chosen, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got.ranks, ranks)
    np.testing.assert_array_equal(got.token_ids, targets)
    assert got.top_ids.shape == (rows, k) and got.top_logprobs.shape == (rows, k)
    if k:
        np.testing.assert_allclose(got.top_logprobs, top.values.numpy(), atol=1e-5, rtol=0)
        # the ids carry exactly the logprobs reported for them (ties may order differently from torch)
        np.testing.assert_allclose(np.take_along_axis(lp, got.top_ids, 1), got.top_logprobs, atol=1e-5, rtol=0)
        assert (np.diff(got.top_logprobs, axis=1) <= 0).all()


def test_extreme_and_masked_rows() -> None:
    """Huge logits do not overflow; -inf entries (masked tokens) give -inf logprobs, not NaN."""
    logits = np.array([[1e30, -1e30, 0.0, 3.0], [-np.inf, 0.0, 1.0, -np.inf], [5.0, 5.0, 5.0, 5.0]], np.float32)
    targets = np.array([0, 0, 2])
    got = reduce_logprob_rows(logits, targets, 2)
    _, chosen, ranks, _ = _torch_reference(logits, targets, 2)
    assert np.isfinite(got.logprobs[[0, 2]]).all() and got.logprobs[1] == -np.inf
    np.testing.assert_allclose(got.logprobs[[0, 2]], chosen[[0, 2]], atol=1e-6)
    np.testing.assert_array_equal(got.ranks, ranks)
    assert got.ranks[2] == 4  # four equally likely tokens: all at least as likely as the scored one
    np.testing.assert_allclose(got.top_logprobs[2], [np.log(0.25)] * 2, atol=1e-6)
    assert got.top_ids[2].tolist() == [0, 1]  # ties by token id


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="rows"):
        reduce_logprob_rows(np.zeros((2, 4), np.float32), [1], 1)
    with pytest.raises(ValueError, match="vocab"):
        reduce_logprob_rows(np.zeros(4, np.float32), [1], 1)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        reduce_logprob_rows(np.zeros((1, 4), np.float32), [4], 1)


def test_dicts_hold_top_k_and_the_scored_token() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    rows = reduce_logprob_rows(logits, [3], 2)
    (entry,) = logprob_dicts(rows, lambda t: f"<{t}>")
    assert list(entry) == [0, 1, 3]
    assert entry[3].rank == 4 and entry[0].rank == 1 and entry[1].rank == 2
    assert entry[3].decoded == "<3>"
    assert entry[3].logprob == pytest.approx(np.log(0.05), abs=1e-6)
    (entry,) = logprob_dicts(reduce_logprob_rows(logits, [1], 2), str)
    assert list(entry) == [0, 1] and entry[1].rank == 2
