"""Sampler: next tokens for a batch of logits rows, vectorised over the batch with numpy.

Order of processing (vLLM semantics): logit_bias, penalties (repetition over prompt+output tokens:
positive logits divided, negative multiplied; presence/frequency over output tokens), min_tokens
(EOS and stop ids suppressed until reached). Logprobs are the log-softmax of these processed logits.
Then greedy rows take the argmax; the others are divided by temperature, filtered by top_k, top_p,
min_p and sampled with the request's own np.random.Generator (one uniform draw per token), so a
seeded request gives the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.runtime.request import Request


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: top-k tokens + the chosen one (None if not asked)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


class Sampler:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: np.ndarray, reqs: list[Request]) -> SamplerOutput:
        logits = np.array(logits, dtype=np.float32, copy=True)
        self._apply_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        self._apply_min_tokens(logits, reqs)
        logprob_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        lp = log_softmax(logits[logprob_rows]) if logprob_rows else None

        tokens = np.argmax(logits, axis=-1)  # greedy rows keep this
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            tokens[rand] = self._sample(logits[rand], [reqs[i] for i in rand])

        out_lp: list[dict[int, float] | None] = [None] * len(reqs)
        for j, i in enumerate(logprob_rows):
            k = reqs[i].params.logprobs or 0
            row = lp[j]
            top = np.argpartition(-row, k - 1)[:k] if k else np.empty(0, np.int64)
            d = {int(t): float(row[t]) for t in top[np.argsort(-row[top])]}
            d[int(tokens[i])] = float(row[tokens[i]])
            out_lp[i] = d
        return SamplerOutput(token_ids=[int(t) for t in tokens], logprobs=out_lp)

    # -- logits processors --------------------------------------------------------------------------
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
        rows = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0
                or r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
        if not rows:
            return
        v = logits.shape[1]
        counts = np.zeros((len(rows), v), np.float32)
        seen = np.zeros((len(rows), v), bool)
        for j, i in enumerate(rows):
            out = np.asarray(reqs[i].output_token_ids, np.int64)
            out = out[out < v]
            np.add.at(counts[j], out, 1.0)
            prompt = np.asarray(reqs[i].prompt_token_ids, np.int64)
            seen[j, prompt[prompt < v]] = True
        seen |= counts > 0
        rep = np.array([reqs[i].params.repetition_penalty for i in rows], np.float32)[:, None]
        pres = np.array([reqs[i].params.presence_penalty for i in rows], np.float32)[:, None]
        freq = np.array([reqs[i].params.frequency_penalty for i in rows], np.float32)[:, None]
        sub = logits[rows]
        sub = np.where(seen, np.where(sub > 0, sub / rep, sub * rep), sub)
        sub -= freq * counts + pres * (counts > 0)
        logits[rows] = sub

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
        probs = self.distribution(logits, reqs)
        cdf = np.cumsum(probs, axis=-1)
        u = np.array([r.generator.random() for r in reqs]) * cdf[:, -1]
        idx = (cdf <= u[:, None]).sum(axis=-1)
        return np.minimum(idx, probs.shape[1] - 1)

    @staticmethod
    def distribution(logits: np.ndarray, reqs: list[Request]) -> np.ndarray:
        """Probabilities to sample from (float64, unnormalised after min_p): temperature, top_k, top_p, min_p."""
        temp = np.array([r.params.temperature for r in reqs], np.float32)[:, None]
        logits = logits / temp
        top_k = np.array([r.params.top_k for r in reqs])
        top_p = np.array([r.params.top_p for r in reqs], np.float64)
        filt = np.nonzero((top_k > 0) | (top_p < 1.0))[0]
        if filt.size:
            sub = logits[filt]
            s = -np.sort(-sub, axis=-1)  # descending
            v = s.shape[1]
            k = np.where(top_k[filt] > 0, np.minimum(top_k[filt], v), v)
            s[np.arange(v)[None, :] >= k[:, None]] = -np.inf
            p = softmax(s.astype(np.float64))
            keep = (np.cumsum(p, axis=-1) - p) < top_p[filt][:, None]
            n_keep = np.maximum(keep.sum(axis=-1), 1)
            thr = s[np.arange(len(filt)), n_keep - 1]
            sub[sub < thr[:, None]] = -np.inf
            logits[filt] = sub
        probs = softmax(logits.astype(np.float64))
        min_p = np.array([r.params.min_p for r in reqs])
        if np.any(min_p > 0):
            probs[probs < min_p[:, None] * probs.max(axis=-1, keepdims=True)] = 0.0
        return probs
