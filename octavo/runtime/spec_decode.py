"""Speculative decoding's rules in the scheduler: who may speculate, how many drafts next, and the counters.

- `can_speculate`: a request decoding one token a step (no prompt or recompute left), not a beam. (A request
  with a grammar speculates too: each draft row gets the mask of the matcher advanced over the drafts before
  it, runtime/structured_outputs.py.)
- `next_spec_limit`: the adaptive draft length. A request whose drafts were all accepted may propose one
  more next time (up to num_speculative_tokens); one whose drafts were all rejected proposes half as many
  (at least one). Text that does not repeat its context thus costs at most a draft row a step, and the
  n-gram proposer proposes nothing at all where no n-gram matches.
- `SpecDecodeStats`: vLLM's spec-decode counters (num_drafts, num_draft_tokens, num_accepted_tokens, and
  accepted tokens per draft position), exported in /metrics and engine.stats().
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from octavo.runtime.ngram_proposer import NgramProposer
from octavo.runtime.request import Request
from octavo.runtime.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from octavo.runtime.engine_args import EngineArgs


class Proposer(Protocol):
    """Where draft tokens come from (the scheduler asks for each request that may speculate)."""

    def propose(self, req: Request, k: int) -> list[int]: ...


def make_proposer(config: SpeculativeConfig, args: EngineArgs, vocab_size: int, max_model_len: int) -> Proposer:
    """The proposer CONFIG names: n-gram lookup, or a draft model loaded now."""
    if config.method == "draft_model":
        from octavo.runtime.draft_proposer import DraftModelProposer

        return DraftModelProposer(config.model, args, vocab_size, max_model_len)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def can_speculate(req: Request) -> bool:
    return req.num_tokens - req.num_computed_tokens == 1 and not req.params.use_beam_search


def next_spec_limit(limit: int, proposed: int, accepted: int, most: int) -> int:
    """The draft length a request may propose next, after ACCEPTED of PROPOSED drafts (LIMIT before)."""
    if accepted == proposed:
        return min(most, limit + 1)
    if accepted == 0:
        return max(1, limit // 2)
    return limit


@dataclass(slots=True)
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verification steps of requests that had drafts
    num_draft_tokens: int = 0  # draft tokens proposed (and verified)
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at draft position i

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
