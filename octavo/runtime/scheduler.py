"""Scheduler: each step decides {request: num_tokens} under a token budget and a sequence cap.

One mechanism (vLLM v1's view): a request has `num_tokens` (prompt + sampled) and `num_computed_tokens`
(K/V in the cache); scheduling gives it up to the difference — a decode, a prefill chunk, a recompute
after preemption. Running requests first (on a full pool the most recently admitted is preempted), then
waiting ones by (priority, arrival) while budget, blocks and seats last; prompts with more than
`long_prefill_token_threshold` tokens left share that many tokens per step (`_chunk`). A waiting request
whose next prefix block another request is computing is HELD (cold shared prefixes). docs/engine.md
explains each rule and why none deadlocks or starves.

Speculative decoding (EngineArgs.speculative_config): a decoding request may also be given draft tokens
(`Request.spec_token_ids`, from the proposer) that the target computes in the same step, after its last
token, like a prefill chunk; its logits rows verify them (runtime/rejection_sampler.py).

It also owns the commit (nano-vllm's postprocess, vLLM's update_from_output): `update_from_output`
advances computed tokens (the block manager caches the blocks that filled), appends each request's
tokens of the step (one; or, with drafts, the accepted drafts and the target's next token), checks the
token stops (EOS, stop ids, max_tokens, context) after each, and finishes and frees what ended. Rejected
drafts are rolled back: only the accepted tokens' KV counts as computed (so only those can ever fill a
block offered to the prefix cache; the rejected slots are overwritten by the next step) and the blocks
allocated past the request's tokens go back to the pool. `append_output` is the one writer of output
tokens (beam search appends through it too) and of the token counters; `adopt` takes a forked request
that already holds blocks. Stop strings are found in the text by the output processor, after which the
engine calls `finish(req, "stop", keep_tokens=...)` (a stop inside a run of accepted tokens cuts there).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.pooling import usable_pooled_blocks
from octavo.runtime.prompt_logprobs import capped_chunk, rows_needed, usable_cached_blocks
from octavo.runtime.request import Request, RequestStatus
from octavo.runtime.spec_decode import Proposer, SpecDecodeStats, can_speculate, next_spec_limit
from octavo.runtime.speculative_config import SpeculativeConfig
from octavo.runtime.stop_check import check_stop
from octavo.runtime.structured_outputs import commit_token, release_grammar


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: dict[Request, int] = field(default_factory=dict)  # in packing order
    preempted: list[Request] = field(default_factory=list)
    held: list[Request] = field(default_factory=list)  # waiting on a prefix block another request is computing


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, *,
                 long_prefill_token_threshold: int = 0, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None, max_prompt_logprob_rows: int | None = None,
                 speculative_config: SpeculativeConfig | None = None, proposer: Proposer | None = None) -> None:
        self.block_manager = block_manager
        self.spec = speculative_config
        self.proposer = proposer if self.spec is not None else None  # (spec_decode.make_proposer)
        self.spec_stats = SpecDecodeStats(self.spec.num_speculative_tokens if self.spec else 0)
        self.max_prompt_logprob_rows = max_prompt_logprob_rows  # per step (None: no cap); see prompt_logprobs.py
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill = long_prefill_token_threshold  # see _chunk
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by (priority, arrival_order)
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.finished: list[Request] = []  # finished since the engine last took them (its step record)
        self.num_preemptions = 0
        self.prompt_tokens_total = 0  # prompt tokens computed (cache hits excluded, recomputes included)
        self.generation_tokens_total = 0  # tokens sampled

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: (r.priority, r.arrival_order))

    def _chunk(self, left: int, budget: int, long_left: int) -> tuple[int, int]:
        """(tokens to compute now, what is left of the long-prefill share) for a request with LEFT tokens to
        compute. Requests with more than `long_prefill` left share `long_prefill` tokens per step, so a
        long prompt is chunked beside decodes and short prompts instead of taking the whole budget."""
        if left > self.long_prefill > 0:
            n = min(left, budget, long_left)
            return n, long_left - n
        return min(left, budget), long_left

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget, long_left, deferred = self.max_num_batched_tokens, self.long_prefill, 0
        rows = self.max_prompt_logprob_rows if self.max_prompt_logprob_rows is not None else budget
        running, self.running = self.running, []
        speculate = self.spec is not None and (self.spec.disable_by_batch_size is None
                                               or len(running) <= self.spec.disable_by_batch_size)
        while running:
            req = running.pop(0)
            n, new_long_left = self._chunk(req.num_tokens - req.num_computed_tokens, budget, long_left)
            n = capped_chunk(req, req.num_computed_tokens, n, rows)
            # n == 0 also for a beam that has its logprobs and waits for its siblings', and when its
            # prompt-logprob rows do not fit this step; forked beams can outnumber the seats (max_num_seqs)
            if n == 0 or len(out.scheduled) == self.max_num_seqs:
                self.running.append(req)
                continue
            drafts = self._drafts(req, min(budget - n, rows)) if speculate and n == 1 else []
            while not self.block_manager.allocate(req, n + len(drafts)):
                if drafts:  # no room for the drafts' KV: decode one token (nobody is preempted for a draft)
                    drafts = []
                    continue
                victim = running.pop() if running else req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                req.spec_token_ids = drafts
                out.scheduled[req] = n + len(drafts)
                budget, long_left = budget - n - len(drafts), new_long_left
                rows -= rows_needed(req, req.num_computed_tokens, n) + len(drafts)
                self.running.append(req)
        if out.preempted:
            return out  # under memory pressure: admit nobody this step
        i = 0  # waiting[:i] are held this step
        while i < len(self.waiting) and budget and len(self.running) + len(out.held) + deferred < self.max_num_seqs:
            req = self.waiting[i]
            found = self.block_manager.find_cached(req)
            cached = usable_cached_blocks(req, found, self.block_manager.block_size)  # prompt logprobs: compute
            cached = usable_pooled_blocks(req, cached, self.block_manager.block_size)  # mean / cls pooling: too
            if len(cached) == len(found) and self.block_manager.producer_of_next(req, len(cached)) is not None:
                out.held.append(req)
                i += 1
                continue
            start = len(cached) * self.block_manager.block_size
            n, new_long_left = self._chunk(req.num_tokens - start, budget, long_left)
            if n == 0:  # a long prompt while others take the long-prefill share: it keeps its place and seat
                deferred += 1
                i += 1
                continue
            n = capped_chunk(req, start, n, rows)
            if n == 0 or not self.block_manager.can_admit(req, cached, n):
                break  # FCFS: nobody overtakes the first request that is not held
            self.waiting.pop(i)
            self.block_manager.admit(req, cached)
            if not self.block_manager.allocate(req, n):  # can_admit said yes; this cannot happen
                raise RuntimeError("block manager refused an allocation it had accepted")
            self.block_manager.promise(req)
            if req.metrics.first_scheduled_time is None:  # its first admission
                req.metrics.num_cached_tokens = req.num_computed_tokens
                req.metrics.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            out.scheduled[req] = n
            budget, long_left = budget - n, new_long_left
            rows -= rows_needed(req, start, n)
            self.running.append(req)
        return out

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Draft tokens for REQ, a decode this step: at most its adaptive limit, ROOM (the step's token budget
        and logits rows left), and what its max_tokens and the context still allow."""
        if self.proposer is None or not can_speculate(req):
            return []
        k = min(req.spec_limit or self.spec.num_speculative_tokens, room,
                req.max_tokens - req.num_output_tokens - 1)
        if self.max_model_len is not None:  # every draft's position must fit the context
            k = min(k, self.max_model_len - req.num_tokens)
        return self.proposer.propose(req, k) if k > 0 else []

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.block_manager.release(req)
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        self.add(req)

    # -- the commit ---------------------------------------------------------------------------------
    def update_from_output(self, scheduled: dict[Request, int], sampled: list[Request],
                           token_ids: list[list[int]]) -> list[int]:
        """A step ran: its scheduled tokens are in the KV cache, and SAMPLED (the requests that had logits
        rows, in row order) got TOKEN_IDS: per request its tokens of this step (one; with drafts, the
        accepted drafts and then the target's own next token). The place where accepted tokens become part
        of a request (a grammar matcher advances on the same list; see docs/architecture.md). Returns, per
        SAMPLED request, how many of its tokens it took (fewer when one of them ended it)."""
        for req, n in scheduled.items():  # the KV of tokens already known: prompts, each request's last token
            self.prompt_tokens_total += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
            self.block_manager.commit(req, min(n, req.num_tokens - req.num_computed_tokens))
        now = time.time()
        taken = []
        for req, toks in zip(sampled, token_ids):
            drafts = len(req.spec_token_ids)  # (finishing clears them)
            taken.append(self.append_output(req, toks, now))
            if drafts:
                self._settle_drafts(req, drafts, len(toks) - 1)
        return taken

    def _settle_drafts(self, req: Request, drafts: int, accepted: int) -> None:
        """REQ's DRAFTS were verified, ACCEPTED of them (its leading ones) taken: their KV counts as computed
        now that they are its tokens; the rejected ones' slots and blocks are rolled back."""
        self.spec_stats.record(drafts, accepted)
        req.spec_limit = next_spec_limit(req.spec_limit or self.spec.num_speculative_tokens, drafts, accepted,
                                         self.spec.num_speculative_tokens)
        req.spec_token_ids = []
        if not req.finished:  # (a finished request's blocks are already freed)
            self.block_manager.commit(req, accepted)
            self.block_manager.trim(req)

    def append_output(self, req: Request, tokens: list[int], now: float | None = None, *, stops: bool = True) -> int:
        """Append TOKENS to REQ's output, one at a time, each checked against the token stops (STOPS=False:
        beam search, whose search decides when a beam ends); stops at the one that ends it. Returns how many
        were appended. The one writer of output tokens and of the generated-token counter."""
        now = time.time() if now is None else now
        for i, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            self.generation_tokens_total += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                self._release_followers(req)
            req.metrics.last_token_time = now
            if stops:
                self._check_stops(req, tok)
                if req.finished:
                    return i + 1
        return len(tokens)

    def _check_stops(self, req: Request, tok: int) -> None:
        grammar_done = False
        if req.grammar is not None:  # structured outputs: the matcher sees exactly the committed tokens
            res = commit_token(req, tok)
            if res.error is not None:
                self.finish(req, "error", error=res.error)
                return
            grammar_done = res.terminated
        reason, stop_token = check_stop(req, tok, self.eos_token_ids, self.max_model_len, grammar_done)
        if reason is not None:
            self.finish(req, reason, stop_reason=stop_token)

    def adopt(self, req: Request) -> None:
        """REQ already holds KV blocks (forked by beam search): it joins the running requests."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _release_followers(self, req: Request) -> None:
        followers, req.followers = req.followers, []
        for f in followers:
            if not f.finished:
                self.add(f)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None, error: str | None = None,
               keep_tokens: int | None = None) -> None:
        """End req (any state): free its blocks and drop it from the queues. A stop string found in the
        text of a request that ended by length this step relabels it ("stop" wins, as the text ends there).
        KEEP_TOKENS: its output ends after that many tokens (a stop string inside a run of accepted drafts:
        the tokens after it would never have been generated)."""
        if keep_tokens is not None and keep_tokens < req.num_output_tokens:
            self.generation_tokens_total -= req.num_output_tokens - keep_tokens
            del req.output_token_ids[keep_tokens:]
        req.spec_token_ids = []
        if stop_reason is not None:
            req.stop_reason = stop_reason
        if req.finished:
            if reason == "stop" and req.finish_reason == "length":
                req.finish_reason = reason
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:  # (a follower of an n > 1 request may not have been queued yet)
            self.waiting.remove(req)
        self.block_manager.release(req)
        release_grammar(req)
        if hasattr(self.proposer, "release"):  # a draft model's copy of req in its own pool
            self.proposer.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.error = reason, error
        req.metrics.finished_time = time.time()
        self.finished.append(req)
        self._release_followers(req)

    def take_finished(self) -> list[Request]:
        """The requests finished since the previous call (for the engine's step record)."""
        finished, self.finished = self.finished, []
        return finished
