"""Scheduler: each step decides {request: num_tokens} under a token budget and a sequence cap.

One mechanism for everything (vLLM v1's view): a request has `num_tokens` (prompt + sampled) and
`num_computed_tokens` (K/V in the cache); scheduling gives it up to the difference. A decode is 1
token, a prefill chunk is many, a recompute after preemption is just a long prefill. Order:
1. running requests (admission order): the next chunk or decode; when the pool is out of blocks,
   preempt the most recently admitted running request (free its blocks, back to the front of the
   waiting queue; the prefix cache makes the recompute cheap);
2. then waiting requests, by (priority, arrival) — FCFS by default — while budget, blocks and
   max_num_seqs last. A prefix-cache hit skips the cached tokens (never the last one).
Requests that can never fit are rejected before they get here (see LLMEngine.add_request).

Cold shared prefixes: an admitted request promises the full blocks it is about to compute
(BlockManager.promise). A waiting request whose first uncached prefix block is promised is HELD:
it stays in the queue, takes no budget and no blocks, and is looked at again next step, when it
finds the filled blocks in the prefix cache (or is held on the next one). Requests arriving together
with one long system prompt therefore compute it once. Why this cannot deadlock or starve: only
running requests hold promises, a held request blocks no running request, and a running request
either progresses (it fills the block) or leaves the running set (finished, aborted, failed,
preempted), which withdraws its promises — so every hold ends within finitely many steps. A held
request keeps its place: it still counts against max_num_seqs for those queued behind it, so they
overtake it only into seats it does not need this step. With nothing promised the check is one
emptiness test per admitted request.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: dict[Request, int] = field(default_factory=dict)  # in packing order
    preempted: list[Request] = field(default_factory=list)
    held: list[Request] = field(default_factory=list)  # waiting on a prefix block another request is computing

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by (priority, arrival_order)
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: (r.priority, r.arrival_order))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running, self.running = self.running, []
        while running:
            req = running.pop(0)
            if budget == 0:
                self.running.append(req)
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate(req, n):
                victim = running.pop() if running else req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled[req] = n
                budget -= n
                self.running.append(req)
        if out.preempted:
            return out  # under memory pressure: admit nobody this step
        i = 0  # waiting[:i] are held this step
        while i < len(self.waiting) and budget and len(self.running) + len(out.held) < self.max_num_seqs:
            req = self.waiting[i]
            cached = self.block_manager.find_cached(req)
            if self.block_manager.producer_of_next(req, len(cached)) is not None:
                out.held.append(req)
                i += 1
                continue
            n = min(req.num_tokens - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.can_admit(req, cached, n):
                break  # FCFS: nobody overtakes the first request that is not held
            self.waiting.pop(i)
            self.block_manager.admit(req, cached)
            if not self.block_manager.allocate(req, n):  # can_admit said yes; this cannot happen
                raise RuntimeError("block manager refused an allocation it had accepted")
            self.block_manager.promise(req)
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = req.num_computed_tokens
                req.metrics.num_cached_tokens = req.num_computed_tokens
                req.metrics.first_scheduled_time = time.time()
                self.block_manager.prefix_queries += req.num_prompt_tokens
                self.block_manager.prefix_hits += req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            out.scheduled[req] = n
            budget -= n
            self.running.append(req)
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.block_manager.release(req)
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        self.add(req)

    def finish(self, req: Request, reason: str) -> None:
        """End req (any state): free its blocks and drop it from the queues."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:  # (a WAITING request may not have been added yet: see n > 1)
            self.waiting.remove(req)
        self.block_manager.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
