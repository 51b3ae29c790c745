"""Sampler: next tokens for a batch of logits rows, vectorised over the batch with numpy.

Order of processing (vLLM semantics): the grammar's token bitmask of structured-output rows (tokens it
forbids get -inf, before anything else sees the logits; see octavo/structured/), allowed_token_ids (every
other token -inf), logit_bias, penalties (repetition over prompt+output tokens:
positive logits divided, negative multiplied; presence/frequency over output tokens), min_tokens
(EOS and stop ids suppressed until reached). Logprobs are the log-softmax of these processed logits: the top-k and the
chosen token, or (logprob_token_ids) the chosen token and exactly the asked ids, in that order.
Then greedy rows take the argmax; the others are divided by temperature, filtered by top_k, top_p,
min_p and sampled with the request's own np.random.Generator (one uniform draw per token), so a
seeded request gives the same tokens whatever else is in the batch. A constrained row left with no
allowed token (min_tokens holding back the EOS that is all its grammar allows) gets its EOS back: the
grammar is complete, and the request ends rather than failing the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.runtime.request import Request


# temperatures below this sample as if at this (practically greedy): logits / 1e-38 overflow float32 to
# inf, and inf - inf = NaN weights made every such row pick the last vocabulary id
MIN_TEMPERATURE = 1e-5
# ... and above this a temperature changes nothing any more (every logit / it is ~0: uniform); larger
# values (SamplingParams accepts any finite one) would overflow the float32 divisor
MAX_TEMPERATURE = 1e30
# SamplingParams accepts any finite repetition_penalty > 0 (as vLLM does). A penalised logit is kept within
# this magnitude so that dividing it by MIN_TEMPERATURE and subtracting a row's max stay finite in float32
PENALISED_LOGIT_LIMIT = float(np.finfo(np.float32).max) * MIN_TEMPERATURE / 4  # ~8.5e32
# ... and the penalised side's largest magnitude is kept above this, so that its tokens keep their order
# instead of underflowing to 0 together; next to an unpenalised logit it weighs nothing even in float64
PENALISED_LOGIT_FLOOR = 1e-20


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: top-k tokens + the chosen one (None if not asked)


def draw(ids: np.ndarray, weights: np.ndarray, generator: np.random.Generator) -> int:
    """One of IDS with probability proportional to WEIGHTS, from one uniform draw of GENERATOR."""
    c = np.cumsum(weights, dtype=np.float64)
    j = int(np.searchsorted(c, generator.random() * c[-1], side="right"))
    return int(ids[min(j, len(ids) - 1)])


def logprob_entry(row: np.ndarray, k: int, token: int, explicit: list[int] | None = None) -> dict[int, float]:
    """A row's logprobs entry: its top K tokens (most likely first) and the chosen TOKEN; with EXPLICIT (vLLM's
    logprob_token_ids), the chosen token first, then exactly those ids."""
    if explicit is not None:
        d = {int(token): float(row[token])}
        d.update((int(t), float(row[t])) for t in explicit if t not in d)
        return d
    top = np.argpartition(-row, k - 1)[:k] if k else np.empty(0, np.int64)
    d = {int(t): float(row[t]) for t in top[np.argsort(-row[top])]}
    d[int(token)] = float(row[token])
    return d


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _plain_greedy(r: Request) -> bool:
    """Greedy, no logits processor active, no logprobs: the token is the argmax of the raw logits."""
    p = r.params
    return (p.temperature == 0.0 and not p.logit_bias and p.logprobs is None and p.allowed_token_ids is None
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and len(r.output_token_ids) >= p.min_tokens)


def _masked_rows(bitmask: np.ndarray | None) -> np.ndarray:
    """Rows of BITMASK that forbid at least one token."""
    if bitmask is None:
        return np.empty(0, np.int64)
    return np.flatnonzero((bitmask != -1).any(axis=1))


def finite_argmax(logits: np.ndarray, reqs: list[Request]) -> np.ndarray:
    """Each row's argmax, after checking the row is usable: a broken backend step (NaN/inf logits) fails
    rather than samples garbage."""
    tokens = np.argmax(logits, axis=-1)
    best = logits[np.arange(len(tokens)), tokens]  # NaN if the row holds a NaN (argmax picks it), else its max
    if not np.isfinite(best).all():
        bad = [reqs[i].request_id for i in np.flatnonzero(~np.isfinite(best))]
        raise FloatingPointError(f"the backend returned non-finite logits (NaN/inf) for {', '.join(bad)}")
    return tokens


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """logits[rows, t] = -inf where bit t of bitmask[rows] is 0, in place (tokens past the mask's width too).
    One gather from a byte -> 8 additive values table and one add (6x faster than unpacking the bits and
    selecting); a NaN logit stays NaN, so a broken backend still fails the step."""
    v = logits.shape[1]
    words = np.ascontiguousarray(bitmask[rows], dtype=np.int32)
    add = np.take(_BYTE_TO_ADDEND, words.view(np.uint8), axis=0).reshape(len(rows), -1)
    if add.shape[1] < v:  # a mask narrower than the logits: the rest is forbidden
        add = np.pad(add, ((0, 0), (0, v - add.shape[1])), constant_values=-np.inf)
    if len(rows) == logits.shape[0]:
        np.add(logits, add[:, :v], out=logits)
    else:
        logits[rows] += add[:, :v]


def _byte_table() -> np.ndarray:
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
    table = np.where(bits, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    table.flags.writeable = False
    return table


_BYTE_TO_ADDEND = _byte_table()  # [256, 8]: byte b -> 0 where its bit is set, -inf where not (read-only)


def repetition_penalised(x: np.ndarray, penalty: float) -> np.ndarray:
    """Seen tokens' logits X under a repetition penalty: positive ones divided, negative ones multiplied.

    An extreme penalty (1e30, 5e-324) saturates instead of overflowing or underflowing: the factor on
    each side is limited so that the side's largest magnitude lands in [PENALISED_LOGIT_FLOOR,
    PENALISED_LOGIT_LIMIT]. One factor per side keeps the order of its tokens (so greedy still picks
    what exact arithmetic picks, for magnitudes within ~1e25 of the side's largest), and at either bound the probabilities next to an unpenalised logit
    are already what the exact values give (0, 1, or unchanged to float64 precision). Computed in
    float64 (no overflow or division by a float32 zero on the way); non-finite logits stay as they are."""
    x64 = x.astype(np.float64)
    out = x64.copy()
    pos, neg = np.isfinite(x64) & (x64 > 0), np.isfinite(x64) & (x64 < 0)
    if pos.any():  # divided by the penalty: grows when it is < 1, shrinks when > 1
        top = float(x64[pos].max())
        divisor = max(penalty, top / PENALISED_LOGIT_LIMIT)
        if divisor > 1:  # shrinking: not below the floor (nor at all if already there)
            divisor = min(divisor, max(1.0, top / PENALISED_LOGIT_FLOOR))
        out[pos] = x64[pos] / divisor
    if neg.any():  # multiplied: grows when > 1, shrinks when < 1
        top = float(-x64[neg].min())
        factor = min(penalty, PENALISED_LOGIT_LIMIT / top)
        if factor < 1:
            factor = max(factor, min(1.0, PENALISED_LOGIT_FLOOR / top))
        out[neg] = x64[neg] * factor
    return out.astype(np.float32)


class Sampler:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: np.ndarray, reqs: list[Request], bitmask: np.ndarray | None = None) -> SamplerOutput:
        """BITMASK: None, or [len(reqs), ceil(vocab / 32)] int32 words, bit t of row i = token t allowed for
        reqs[i] (a row of all ones, -1 words, constrains nothing)."""
        processed = self.process(logits, reqs, bitmask)
        if processed is None:  # nothing changes the logits: no copy
            return self._plain_argmax(logits, reqs)
        logits = processed
        logprob_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        lp = log_softmax(logits[logprob_rows]) if logprob_rows else None

        tokens = finite_argmax(logits, reqs)  # greedy rows keep this
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            tokens[rand] = self._sample(logits[rand], [reqs[i] for i in rand])

        out_lp: list[dict[int, float] | None] = [None] * len(reqs)
        for j, i in enumerate(logprob_rows):
            out_lp[i] = logprob_entry(lp[j], min(reqs[i].params.logprobs or 0, lp.shape[1]), int(tokens[i]),
                                      reqs[i].params.logprob_token_ids)
        return SamplerOutput(token_ids=[int(t) for t in tokens], logprobs=out_lp)

    def process(self, logits: np.ndarray, reqs: list, bitmask: np.ndarray | None = None) -> np.ndarray | None:
        """LOGITS after every logits processor (bitmask, bias, penalties, min_tokens), as a float32 copy; None
        when none changes them and every row is greedy (the tokens are the raw rows' argmax). REQS: per row,
        anything with a Request's params, prompt/output token ids and request_id (the rejection sampler
        passes draft positions)."""
        masked = _masked_rows(bitmask)
        if not masked.size and all(_plain_greedy(r) for r in reqs):
            return None
        logits = np.array(logits, dtype=np.float32, copy=True)
        if masked.size:
            apply_token_bitmask(logits, bitmask, masked)
        self._apply_allowed(logits, reqs)
        self._apply_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        self._apply_min_tokens(logits, reqs)
        if masked.size:
            self._revive_dead_rows(logits, masked)
        self._revive_allowed(logits, reqs)
        return logits

    @staticmethod
    def _plain_argmax(logits: np.ndarray, reqs: list[Request]) -> SamplerOutput:
        tokens = finite_argmax(logits, reqs)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=[None] * len(reqs))

    # -- logits processors --------------------------------------------------------------------------
    def _revive_dead_rows(self, logits: np.ndarray, rows: np.ndarray) -> None:
        """Constrained rows where every token is now -inf (not NaN: a broken backend must still fail):
        let their EOS through, so they end instead of sampling from nothing."""
        sub = logits[rows]
        dead = rows[np.all(sub == -np.inf, axis=1)]
        eos = [t for t in self.eos_token_ids if 0 <= t < logits.shape[1]]
        if dead.size and eos:
            logits[np.ix_(dead, eos)] = 0.0

    @staticmethod
    def _apply_allowed(logits: np.ndarray, reqs: list[Request]) -> None:
        """allowed_token_ids (vLLM's): every other token of the row gets -inf."""
        for i, r in enumerate(reqs):
            allowed = r.params.allowed_token_ids
            if allowed is not None:
                ids = np.asarray(allowed, np.int64)
                ids = ids[(ids >= 0) & (ids < logits.shape[1])]
                kept = logits[i, ids].copy()
                logits[i] = -np.inf
                logits[i, ids] = kept

    @staticmethod
    def _revive_allowed(logits: np.ndarray, reqs: list[Request]) -> None:
        """A row whose allowed_token_ids are all held back (min_tokens suppressing the only allowed EOS, a grammar
        allowing none of them) samples among its allowed tokens uniformly rather than from nothing."""
        for i, r in enumerate(reqs):
            if r.params.allowed_token_ids is not None and np.all(logits[i] == -np.inf):
                ids = np.asarray(r.params.allowed_token_ids, np.int64)
                logits[i, ids[(ids >= 0) & (ids < logits.shape[1])]] = 0.0

    @staticmethod
    def _apply_bias(logits: np.ndarray, reqs: list[Request]) -> None:
        for i, r in enumerate(reqs):
            if r.params.logit_bias:
                ids = np.fromiter(r.params.logit_bias.keys(), np.int64)
                vals = np.fromiter(r.params.logit_bias.values(), np.float32)
                ok = (ids >= 0) & (ids < logits.shape[1])
                logits[i, ids[ok]] += vals[ok]

    @staticmethod
    def _apply_penalties(logits: np.ndarray, reqs: list[Request]) -> None:
        v = logits.shape[1]
        for i, r in enumerate(reqs):
            p = r.params
            if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
                continue
            out_ids, counts = np.unique(np.asarray(r.output_token_ids, np.int64), return_counts=True)
            counts, out_ids = counts[out_ids < v], out_ids[out_ids < v]
            if p.repetition_penalty != 1.0:
                seen = np.union1d(np.asarray(r.prompt_token_ids, np.int64), out_ids)
                seen = seen[seen < v]
                logits[i, seen] = repetition_penalised(logits[i, seen], p.repetition_penalty)
            if out_ids.size and (p.presence_penalty or p.frequency_penalty):
                logits[i, out_ids] -= p.frequency_penalty * counts + p.presence_penalty

    def _apply_min_tokens(self, logits: np.ndarray, reqs: list[Request]) -> None:
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                ids = list(r.params.stop_token_ids or [])
                if not r.params.ignore_eos:
                    ids += self.eos_token_ids
                ids = [t for t in ids if 0 <= t < logits.shape[1]]
                logits[i, ids] = -np.inf

    # -- random sampling ----------------------------------------------------------------------------
    def _sample(self, logits: np.ndarray, reqs: list[Request]) -> np.ndarray:
        tokens = np.empty(len(reqs), np.int64)
        for i, r in enumerate(reqs):
            ids, w = self.candidates(logits[i], r)
            tokens[i] = draw(ids, w, r.generator)
        return tokens

    @staticmethod
    def candidates(row: np.ndarray, req: Request) -> tuple[np.ndarray, np.ndarray]:
        """Token ids a sampled row may take and their unnormalised weights, after temperature, top_k,
        top_p (on the top_k-restricted distribution) and min_p, without sorting the vocabulary: top_k
        is a partition; top_p sorts only tokens with p >= (1 - top_p) / n, a superset of the nucleus
        (a token below that could only be reached after tokens of mass > 1 - top_p, all as small)."""
        p = req.params
        x = row.astype(np.float32) / np.float32(min(max(p.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE))
        v = x.shape[0]
        m = x.max()
        ids: np.ndarray | None = None
        if 0 < p.top_k < v:
            kth = np.partition(x, v - p.top_k)[v - p.top_k]
            ids = np.flatnonzero(x >= kth)  # ties with the k-th value stay (as in transformers)
            w = np.exp(x[ids] - m)
        else:
            w = np.exp(x - m)
        if p.top_p < 1.0:
            total = w.sum(dtype=np.float64)
            sel = np.flatnonzero(w >= (1.0 - p.top_p) * total / w.shape[0])
            order = sel[np.argsort(-w[sel], kind="stable")]
            ws = w[order]
            before = (np.cumsum(ws, dtype=np.float64) - ws) / total
            order = order[: max(1, int(np.count_nonzero(before < p.top_p)))]
            ids = order if ids is None else ids[order]
            w = w[order]
        if ids is None:
            ids = np.arange(v)
        if p.min_p > 0.0:
            keep = w >= p.min_p * w.max()
            ids, w = ids[keep], w[keep]
        return ids, w
