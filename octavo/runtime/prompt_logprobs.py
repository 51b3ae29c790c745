"""Prompt logprobs: one prefill chunk's logits rows reduced to what a scoring request keeps.

A request with SamplingParams.prompt_logprobs = k asks, for every prompt position p >= 1, the logprob of
prompt token p given tokens 0..p-1, its rank, and the k most likely tokens there (vLLM's semantics; the
first position has no context and gets None). The logits that predict token p are the row of position
p - 1, so a chunk covering positions [start, end) scores prompt tokens start+1 .. end.

In the engine (docs/evaluation.md, "Prompt logprobs in the engine"): `prompt_rows` picks, per scheduled chunk, the positions
whose logits a request still needs; ModelRunner.prepare appends those rows to `logits_indices` after the
rows to sample; the OutputProcessor reduces them right after the step (`reduce_logprob_rows`) and attaches
the finished list to the request's first output. `Request.prompt_logprobs_next` is the first prompt
position not reduced yet, so a request preempted and recomputed is not scored twice, and
`usable_cached_blocks` keeps the prefix cache from skipping positions still needed (a request asking for
prompt logprobs computes its prompt; its blocks still go into the cache for others).

Memory stays bounded by the chunk: the engine reduces each chunk's [rows, vocab] logits as soon as the
backend returns them (a 4k prompt x 49152 vocabulary in float32 would be 800 MB kept whole), and the
reduction itself works through the rows a few at a time, so its temporaries are [rows_per_pass, vocab].
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from octavo.runtime.outputs import Logprob
from octavo.runtime.request import Request

ROWS_PER_PASS = 64  # rows whose log-softmax exists at once (64 x 49152 float32 = 12.6 MB)
STEP_LOGITS_BYTES = 256 << 20  # prompt-logprob rows of one step: at most this much float32 logits


@dataclass(slots=True)
class LogprobRows:
    """Per logits row: the target token's logprob and rank, and the top-k tokens (most likely first)."""

    token_ids: np.ndarray  # [rows] int64, the token each row scores
    logprobs: np.ndarray  # [rows] float32
    ranks: np.ndarray  # [rows] int64; 1 = the most likely token (vLLM: tokens at least as likely, itself included)
    top_ids: np.ndarray  # [rows, k] int64
    top_logprobs: np.ndarray  # [rows, k] float32

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def reduce_logprob_rows(logits: np.ndarray, targets: Sequence[int] | np.ndarray, k: int,
                        rows_per_pass: int = ROWS_PER_PASS) -> LogprobRows:
    """log_softmax each row of LOGITS [rows, vocab] and keep TARGETS' logprob and rank and the top K.

    Works ROWS_PER_PASS rows at a time in float32 (the graph's output type): a row's maximum is subtracted
    before exp, so the sum never overflows, and the logprobs agree with torch.log_softmax to ~1e-6."""
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
    rows, vocab = logits.shape
    tgt = np.asarray(targets, dtype=np.int64).reshape(-1)
    if tgt.shape[0] != rows:
        raise ValueError(f"{rows} logits rows but {tgt.shape[0]} target tokens")
    if rows and (tgt.min() < 0 or tgt.max() >= vocab):
        raise ValueError(f"target token ids must be in [0, {vocab})")
    k = max(0, min(int(k), vocab))
    chosen = np.empty(rows, np.float32)
    ranks = np.empty(rows, np.int64)
    top_ids = np.empty((rows, k), np.int64)
    top_lps = np.empty((rows, k), np.float32)
    for lo in range(0, rows, max(1, rows_per_pass)):
        hi = min(rows, lo + max(1, rows_per_pass))
        x = logits[lo:hi].astype(np.float32, copy=False)
        lp = _log_softmax(x)
        r = np.arange(hi - lo)
        mine = lp[r, tgt[lo:hi]]
        chosen[lo:hi] = mine
        ranks[lo:hi] = np.count_nonzero(lp >= mine[:, None], axis=1)
        if k:
            part = np.argpartition(-lp, k - 1, axis=1)[:, :k] if k < vocab else np.tile(np.arange(vocab), (hi - lo, 1))
            vals = np.take_along_axis(lp, part, axis=1)
            order = np.lexsort((part, -vals), axis=1)  # most likely first; equal logprobs by token id
            top_ids[lo:hi] = np.take_along_axis(part, order, axis=1)
            top_lps[lo:hi] = np.take_along_axis(vals, order, axis=1)
    return LogprobRows(tgt.copy(), chosen, ranks, top_ids, top_lps)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0).astype(x.dtype)  # an all -inf row stays -inf, not NaN
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=1, keepdims=True))


def logprob_dicts(rows: LogprobRows, decode: Callable[[int], str]) -> list[dict[int, Logprob]]:
    """vLLM's per-position shape: {token_id: Logprob} holding the top-k and the scored token (with its rank)."""
    out: list[dict[int, Logprob]] = []
    for i in range(len(rows)):
        tid = int(rows.token_ids[i])
        entry: dict[int, Logprob] = {}
        for j, (t, v) in enumerate(zip(rows.top_ids[i].tolist(), rows.top_logprobs[i].tolist())):
            entry[t] = Logprob(t, v, decode(t), rank=j + 1)
        if tid in entry:
            entry[tid].rank = int(rows.ranks[i])
        else:
            entry[tid] = Logprob(tid, float(rows.logprobs[i]), decode(tid), rank=int(rows.ranks[i]))
        out.append(entry)
    return out


def max_prompt_logprob_rows(backend: object, max_num_seqs: int, vocab_size: int) -> int:
    """Prompt-logprob rows one step may ask for: STEP_LOGITS_BYTES of logits, and within what the backend
    returns (a TensorRT engine's max_num_logits, fixed when it was built, also holds the rows to sample)."""
    rows = max(1, STEP_LOGITS_BYTES // (4 * vocab_size))
    built_limit = getattr(getattr(backend, "info", None), "max_num_logits", None)
    if isinstance(built_limit, int):
        rows = min(rows, built_limit - max_num_seqs)
    return rows


def wants_prompt_rows(req: Request) -> bool:
    """REQ still needs logits rows of its prompt: it asked for prompt logprobs, it is the one child of its
    request that computes them (the others share its prompt), and some prompt token is not scored yet."""
    return (req.params.prompt_logprobs is not None and req.index == 0
            and req.prompt_logprobs_next < req.num_prompt_tokens - 1)


def prompt_rows(scheduled: dict[Request, int]) -> dict[Request, tuple[int, int]]:
    """Per scheduled request that needs them: (first position, count) of this chunk's positions whose logits
    rows score prompt tokens (position p's row scores token p + 1; the prompt's last position samples)."""
    rows: dict[Request, tuple[int, int]] = {}
    for req, n in scheduled.items():
        if not wants_prompt_rows(req):
            continue
        first = max(req.num_computed_tokens, req.prompt_logprobs_next)
        end = min(req.num_computed_tokens + n, req.num_prompt_tokens - 1)
        if end > first:
            rows[req] = (first, end - first)
    return rows


def rows_needed(req: Request, start: int, n: int) -> int:
    """Prompt-logprob rows a chunk of N tokens of REQ from position START needs."""
    if not wants_prompt_rows(req):
        return 0
    return max(0, min(start + n, req.num_prompt_tokens - 1) - max(start, req.prompt_logprobs_next))


def capped_chunk(req: Request, start: int, n: int, rows_left: int) -> int:
    """N, or fewer tokens so that the chunk needs at most ROWS_LEFT rows (0: REQ cannot run this step). Bounds
    the step's logits array (rows x vocabulary) and keeps it within what the backend can return."""
    if rows_needed(req, start, n) <= rows_left:
        return n
    return max(start, req.prompt_logprobs_next) + rows_left - start  # unscored positions first need no rows


def usable_cached_blocks(req: Request, cached: list[int], block_size: int) -> list[int]:
    """The leading CACHED blocks REQ may take from the prefix cache: none that would skip a prompt position
    whose logits row it still needs (all of them when it needs none)."""
    if not wants_prompt_rows(req):
        return cached
    return cached[: req.prompt_logprobs_next // block_size]


__all__ = ["ROWS_PER_PASS", "STEP_LOGITS_BYTES", "LogprobRows", "capped_chunk", "logprob_dicts",
           "max_prompt_logprob_rows", "prompt_rows", "reduce_logprob_rows",
           "rows_needed",
           "usable_cached_blocks", "wants_prompt_rows"]
