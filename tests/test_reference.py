"""The numpy oracle itself, against plain dense causal attention over contiguous K/V (no paging)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from op_cases import random_step

from octavo.reference import paged_attention_ref


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, group: int, scale: float,
                    window: int, softcap: float) -> np.ndarray:
    """q [new, H, D]; k, v [past+new, KVH, D] in position order. Loops, one query row at a time."""
    new, heads, _ = q.shape
    out = np.zeros(q.shape)
    for i in range(new):
        pos = past + i
        first = max(0, pos - window + 1) if window > 0 else 0
        for h in range(heads):
            keys = k[first:pos + 1, h // group].astype(np.float64)
            logits = keys @ q[i, h].astype(np.float64) * scale
            if softcap > 0:
                logits = softcap * np.tanh(logits / softcap)
            weights = np.exp(logits - logits.max())
            out[i, h] = (weights / weights.sum()) @ v[first:pos + 1, h // group]
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "block_size", "window", "softcap"),
                         [(4, 4, 1, 0, 0.0), (4, 2, 16, 0, 0.0), (8, 2, 4, 6, 0.0), (4, 1, 8, 0, 4.0),
                          (4, 2, 3, 5, 2.0)])
def test_reference_matches_dense_attention(heads: int, kv_heads: int, block_size: int, window: int,
                                           softcap: float) -> None:
    head_dim = 24
    seqs = [(0, 9), (11, 5), (30, 1), (4, 0)]
    rng = np.random.default_rng(heads * 100 + block_size)
    step = random_step(rng, seqs, num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    # The history of every sequence, in position order, as the cache would hold it.
    history_k = [rng.standard_normal((past, kv_heads, head_dim)).astype(np.float32) for past, _ in seqs]
    history_v = [rng.standard_normal((past, kv_heads, head_dim)).astype(np.float32) for past, _ in seqs]
    for b, (past, _) in enumerate(seqs):
        for pos in range(past):
            block = step.block_table[b, pos // block_size]
            step.key_cache[block, pos % block_size] = history_k[b][pos]
            step.value_cache[block, pos % block_size] = history_v[b][pos]
    scale = 1 / math.sqrt(head_dim)
    got = paged_attention_ref(*step.feeds().values(), num_heads=heads, kv_num_heads=kv_heads, scale=scale,
                              sliding_window=window, softcap=softcap)

    cu = step.cumulative_sequence_length
    for b, (past, new) in enumerate(seqs):
        if new == 0:
            continue
        rows = slice(cu[b], cu[b + 1])
        k = np.concatenate([history_k[b], step.key[rows].reshape(new, kv_heads, head_dim)])
        v = np.concatenate([history_v[b], step.value[rows].reshape(new, kv_heads, head_dim)])
        q = step.query[rows].reshape(new, heads, head_dim)
        want = dense_attention(q, k, v, past, heads // kv_heads, scale, window, softcap)
        np.testing.assert_allclose(got[rows], want.reshape(new, -1), atol=1e-6, rtol=0)


def test_reference_writes_new_kv_at_slots() -> None:
    rng = np.random.default_rng(5)
    step = random_step(rng, [(2, 3), (0, 2)], num_heads=2, kv_num_heads=1, head_dim=8, block_size=2)
    feeds = step.feeds()
    paged_attention_ref(*feeds.values(), num_heads=2, kv_num_heads=1, scale=0.3)
    flat_k = feeds["key_cache"].reshape(-1, 8)
    np.testing.assert_array_equal(flat_k[step.slot_mapping], step.key)
    untouched = np.setdiff1d(np.arange(flat_k.shape[0]), step.slot_mapping)
    np.testing.assert_array_equal(flat_k[untouched], step.key_cache.reshape(-1, 8)[untouched])


def test_reference_with_float16_pools_is_dense_attention_over_rounded_kv() -> None:
    """A float16 pool stores the new K/V rounded (numpy's float16 cast, round to nearest even); the
    oracle then attends over exactly those stored values, the history included."""
    heads, kv_heads, head_dim, block_size = 4, 2, 24, 4
    seqs = [(0, 7), (9, 3), (5, 1)]
    rng = np.random.default_rng(17)
    step = random_step(rng, seqs, num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    feeds = step.feeds()
    for name in ("key_cache", "value_cache"):
        feeds[name] = feeds[name].astype(np.float16)
    history_k, history_v = feeds["key_cache"].copy(), feeds["value_cache"].copy()
    got = paged_attention_ref(*feeds.values(), num_heads=heads, kv_num_heads=kv_heads, scale=0.2)

    assert feeds["key_cache"].dtype == np.float16
    flat_k = feeds["key_cache"].reshape(-1, kv_heads * head_dim)
    np.testing.assert_array_equal(flat_k[step.slot_mapping], step.key.astype(np.float16))
    cu = step.cumulative_sequence_length
    for b, (past, new) in enumerate(seqs):
        rows = slice(cu[b], cu[b + 1])
        table = step.block_table[b]
        old_k = np.stack([history_k[table[p // block_size], p % block_size] for p in range(past)]) if past else \
            np.zeros((0, kv_heads, head_dim), np.float16)
        old_v = np.stack([history_v[table[p // block_size], p % block_size] for p in range(past)]) if past else \
            np.zeros((0, kv_heads, head_dim), np.float16)
        k = np.concatenate([old_k, step.key[rows].astype(np.float16).reshape(new, kv_heads, head_dim)]).astype(np.float32)
        v = np.concatenate([old_v, step.value[rows].astype(np.float16).reshape(new, kv_heads, head_dim)]).astype(np.float32)
        want = dense_attention(step.query[rows].reshape(new, heads, head_dim), k, v, past, heads // kv_heads, 0.2, 0, 0.0)
        np.testing.assert_allclose(got[rows], want.reshape(new, -1), atol=1e-6, rtol=0)


def test_reference_refuses_other_pool_dtypes() -> None:
    step = random_step(np.random.default_rng(2), [(0, 2)], num_heads=2, kv_num_heads=1, head_dim=8, block_size=2)
    feeds = step.feeds()
    feeds["key_cache"] = feeds["key_cache"].astype(np.float64)
    with pytest.raises(TypeError, match="key_cache must be float32 or float16"):
        paged_attention_ref(*feeds.values(), num_heads=2, kv_num_heads=1, scale=0.3)
