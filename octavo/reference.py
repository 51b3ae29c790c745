"""Numpy oracle for `octavo.PagedAttention`: slow, simple, float64 inside. It is the op's spec: the ONNX Runtime
C++ op (plugins/onnxruntime) and the OpenAI-Triton GPU kernel (octavo.tensorrt.gpu_kernel) are tested against it.

It writes the new tokens' K/V into the paged pools (in place, at `slot_mapping`), then, for every
sequence b, gathers positions 0..past+new-1 back out of the pool through `block_table[b]` and runs
causal attention of the new query tokens over them. Token i of sequence b sits at absolute position
past_seqlens[b] + i.

The pools may be float32 or float16 (the op's two pool types). A float16 pool stores the new K/V
rounded to nearest even (numpy's float32 -> float16 cast, the op's rounding); attention then reads
the stored values widened, so the oracle sees exactly what the op can see. Queries and outputs stay
float32.
"""
from __future__ import annotations

import numpy as np

POOL_DTYPES = (np.float32, np.float16)


def _write_new_kv(pool: np.ndarray, new: np.ndarray, slot_mapping: np.ndarray) -> None:
    num_blocks, block_size, kv_heads, head_dim = pool.shape
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # padding token: nothing to store
            continue
        pool[slot // block_size, slot % block_size] = new[t].reshape(kv_heads, head_dim).astype(pool.dtype)


def _gather_sequence(pool: np.ndarray, table_row: np.ndarray, length: int) -> np.ndarray:
    """Positions 0..length-1 of one sequence as [length, kv_heads, head_dim]."""
    block_size = pool.shape[1]
    positions = np.arange(length)
    return pool[table_row[positions // block_size], positions % block_size]


def paged_attention_ref(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    cumulative_sequence_length: np.ndarray,
    past_seqlens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    *,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    """Attention output [T, num_heads*head_dim] (float32); the pools are updated in place."""
    for name, pool in (("key_cache", key_cache), ("value_cache", value_cache)):
        if pool.dtype not in POOL_DTYPES:
            raise TypeError(f"{name} must be float32 or float16, got {pool.dtype}")
    num_tokens = query.shape[0]
    head_dim = query.shape[1] // num_heads
    group = num_heads // kv_num_heads
    _write_new_kv(key_cache, key, slot_mapping)
    _write_new_kv(value_cache, value, slot_mapping)

    output = np.zeros((num_tokens, num_heads, head_dim), dtype=np.float64)
    cu = cumulative_sequence_length.tolist()
    for b, past in enumerate(past_seqlens.tolist()):
        start, end = cu[b], cu[b + 1]
        new = end - start
        if new == 0:
            continue
        total = past + new
        keys = _gather_sequence(key_cache, block_table[b], total).astype(np.float64)
        values = _gather_sequence(value_cache, block_table[b], total).astype(np.float64)
        keys = np.repeat(keys, group, axis=1)  # query head h uses kv head h // group
        values = np.repeat(values, group, axis=1)
        q = query[start:end].reshape(new, num_heads, head_dim).astype(np.float64)

        scores = np.einsum("nhd,thd->hnt", q, keys) * scale
        if softcap > 0:
            scores = softcap * np.tanh(scores / softcap)
        q_pos = past + np.arange(new)[:, None]
        k_pos = np.arange(total)[None, :]
        visible = k_pos <= q_pos
        if sliding_window > 0:
            visible &= k_pos > q_pos - sliding_window
        scores = np.where(visible[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        output[start:end] = np.einsum("hnt,thd->nhd", weights, values)
    return output.reshape(num_tokens, num_heads * head_dim).astype(np.float32)
