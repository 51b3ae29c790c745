"""Embeddings in the engine: a request with SamplingParams.pooling computes its prompt, pools the final-normed hidden
states of its rows and finishes with the vector (RequestOutput.embedding) instead of sampling.

An embedding export's graph (export.pooling_config) has an input `hidden_indices` and an output `hidden_states`
[rows, hidden_size]: the rows the step asks for, after the final norm, beside the logits of the rows that sample.
So embedding requests share steps with generation, chunked prefill and the token budget like any prompt:

- `pooling_rows(scheduled)` picks, per scheduled chunk, the positions whose hidden states a request still needs:
  "last" the prompt's last position, "cls" position 0, "mean" every position of the chunk not pooled yet;
  ModelRunner.prepare puts them into hidden_indices.
- `accept_rows` folds them into the request's PoolState right after the step (a running sum for "mean", so
  what a request holds is one hidden-size vector whatever its length), and `finished_embeddings` gives the
  vectors of the requests whose prompt is complete: truncated to `dimensions` (Matryoshka), then L2-normalized
  when asked. The engine then finishes them ("stop"); their blocks are freed at once.
- `usable_pooled_blocks` keeps the prefix cache from skipping positions a "mean" / "cls" request still needs
  (their blocks still go into the cache for others); "last" takes every cached block, as its last position
  is always computed. PoolState.next makes a preempted and recomputed request pool each position once.
What a request asks and holds (PoolingParams, PoolState): runtime/pooling_params.py.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from octavo.runtime.backends.base import StepInputs
from octavo.runtime.pooling_params import PoolState
from octavo.runtime.request import Request


def pooling_rows(scheduled: dict[Request, int]) -> dict[Request, tuple[int, int]]:
    """Per scheduled embedding request whose chunk has positions it needs: (first position, count)."""
    rows: dict[Request, tuple[int, int]] = {}
    for req, n in scheduled.items():
        if req.pool is not None:
            found = req.pool.rows(req.num_computed_tokens, n, req.num_prompt_tokens)
            if found is not None:
                rows[req] = found
    return rows


def usable_pooled_blocks(req: Request, cached: list[int], block_size: int) -> list[int]:
    """The leading CACHED blocks REQ may take: none that skip a position it still pools."""
    if req.pool is None or req.pool.type == "last":
        return cached
    return cached[: req.pool.next // block_size]


def run_step(backend: Any, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray | None]:
    """(logits, hidden states of inputs.hidden_indices or None when the step asks for none)."""
    if inputs.hidden_indices is None or len(inputs.hidden_indices) == 0:
        return backend.run(inputs), None
    logits, hidden = backend.run_with_hidden(inputs)
    if hidden.shape[0] != len(inputs.hidden_indices):
        raise RuntimeError(f"backend returned {hidden.shape[0]} hidden-state rows, expected {len(inputs.hidden_indices)}")
    return logits, hidden


def accept_rows(rows: dict[Request, tuple[int, int]], hidden: np.ndarray | None) -> None:
    """Fold this step's HIDDEN rows (in the order of ROWS) into the requests' PoolStates."""
    at = 0
    for req, (first, count) in rows.items():
        chunk, at = hidden[at:at + count], at + count  # type: ignore[index]
        state = req.pool
        if state is None or first != max(state.next, first) or req.finished:
            continue
        if state.type == "mean":
            part = chunk.sum(axis=0, dtype=np.float64)
            state.total = part if state.total is None else state.total + part
            state.next = first + count
        else:
            state.total = chunk[0].astype(np.float64)
            state.next = req.num_prompt_tokens if state.type == "cls" else first + 1


def finished_embeddings(scheduled: dict[Request, int]) -> list[tuple[Request, np.ndarray]]:
    """The embedding requests of this step whose prompt is complete (after the commit), with their vectors."""
    done = []
    for req in scheduled:
        state = req.pool
        if state is None or req.finished or req.num_computed_tokens < req.num_prompt_tokens:
            continue
        if state.total is None:
            raise RuntimeError(f"embedding request {req.request_id} has no pooled hidden states")
        done.append((req, embedding(state, req.num_prompt_tokens)))
    return done


def embedding(state: PoolState, num_tokens: int) -> np.ndarray:
    """The request's vector: the pooled rows (a mean over NUM_TOKENS), truncated, normalized; float32."""
    assert state.total is not None
    vec = state.total / num_tokens if state.type == "mean" else state.total
    if state.dimensions is not None:
        vec = vec[: state.dimensions]
    if state.normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec.astype(np.float32)


__all__ = ["accept_rows", "embedding", "finished_embeddings", "pooling_rows", "run_step", "usable_pooled_blocks"]
