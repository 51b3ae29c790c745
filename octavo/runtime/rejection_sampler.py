"""RejectionSampler: a step's tokens per request, verifying draft tokens where a request has them.

A request with k drafts d1..dk has k + 1 logits rows: row j is the target's next-token distribution after its
tokens and d1..dj. Each row goes through the sampler's logits processors as if d1..dj were already output
(`DraftContext`: penalties, logit_bias and min_tokens see exactly what they would without speculation; a
grammar's mask row is the matcher's after those drafts), then:

- greedy: dj+1 is accepted while it equals row j's argmax; the first row that disagrees (or row k) gives
  the token after the accepted drafts. The output is token for token what decoding one token a step gives.
- sampled: the standard rejection sampling (Leviathan et al., Chen et al.) with the proposal q a point mass
  on the draft (an n-gram proposer's draft is deterministic): dj+1 is accepted with probability
  min(1, p(dj+1) / q(dj+1)) = p(dj+1), after top-k/top-p/min-p/temperature; if rejected, the token is drawn
  from the normalised residual max(0, p - q), i.e. p without the draft. Each emitted token is then
  distributed exactly as the target's alone. Draws come from the request's own generator (a seeded request
  is reproducible), and a request without drafts takes exactly the one draw it takes without speculation.

Without any drafts in the step this is the plain sampler's call (no extra work).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.runtime.request import Request
from octavo.runtime.sampler import Sampler, draw, finite_argmax, log_softmax, logprob_entry
from octavo.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class StepTokens:
    token_ids: list[list[int]]  # per request (row order of the step): its tokens of this step
    logprobs: list[list[dict[int, float]] | None]  # per request: one entry per token (None if not asked)


@dataclass(slots=True, eq=False)
class DraftContext:
    """What the sampler reads of a request at draft position j: its output as if d1..dj were appended."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: np.random.Generator

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: np.ndarray, reqs: list[Request], bitmask: np.ndarray | None = None) -> StepTokens:
        """LOGITS: the step's rows to sample (1 + len(req.spec_token_ids) per request of REQS, in order);
        BITMASK: a grammar mask row per logits row (StructuredOutputManager fills draft rows too), or None."""
        counts = [1 + len(r.spec_token_ids) for r in reqs]
        if len(counts) == sum(counts):
            out = self.sampler(logits, reqs, bitmask)
            return StepTokens([[t] for t in out.token_ids],
                              [[lp] if lp is not None else None for lp in out.logprobs])
        rows: list = []
        for r in reqs:
            rows.append(r)
            rows.extend(DraftContext(r.request_id, r.params, r.prompt_token_ids,
                                     r.output_token_ids + r.spec_token_ids[:j], r.generator)
                        for j in range(1, len(r.spec_token_ids) + 1))
        processed = self.sampler.process(logits, rows, bitmask)
        x = processed if processed is not None else logits
        argmax = finite_argmax(x, rows)
        out = StepTokens([], [])
        at = 0
        for r, n in zip(reqs, counts):
            if r.params.greedy:
                toks = _accept_greedy(r.spec_token_ids, argmax[at:at + n])
            else:
                toks = _accept_sampled(r.spec_token_ids, x[at:at + n], rows[at:at + n], r.generator)
            out.token_ids.append(toks)
            k = r.params.logprobs
            if k is None:
                out.logprobs.append(None)
            else:
                lp = log_softmax(x[at:at + len(toks)])
                out.logprobs.append([logprob_entry(lp[j], min(k, lp.shape[1]), t, r.params.logprob_token_ids)
                                     for j, t in enumerate(toks)])
            at += n
        return out


def _accept_greedy(drafts: list[int], argmax: np.ndarray) -> list[int]:
    """The accepted drafts (while each equals its row's argmax) and the argmax of the first row after them."""
    best = argmax.tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return drafts[:a] + [best[a]]


def _accept_sampled(drafts: list[int], x: np.ndarray, rows: list, generator: np.random.Generator) -> list[int]:
    """Rejection sampling with a point-mass proposal: accept draft d with probability p(d), else draw from p
    without d (renormalised); after k accepted drafts, draw the next token from the last row."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        ids, w = Sampler.candidates(x[j], rows[j])
        hit = ids == d
        p_d = float(w[hit].sum(dtype=np.float64) / w.sum(dtype=np.float64))
        if generator.random() < p_d:
            out.append(d)
            continue
        residual = np.where(hit, 0.0, w)
        out.append(draw(ids, residual, generator) if residual.any() else d)
        return out
    ids, w = Sampler.candidates(x[len(drafts)], rows[len(drafts)])
    out.append(draw(ids, w, generator))
    return out
