"""Request: one sequence the engine generates (a prompt, its sampled tokens and its KV bookkeeping).

A request with SamplingParams.n > 1 becomes n Requests ("children") that share the prompt; the prefix
cache lets them share the prompt's full KV blocks. The BlockManager writes the KV fields, the Scheduler
the others (docs/architecture.md, "Who writes what"); the output processor groups children into outputs.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from octavo.runtime.outputs import RequestMetrics
from octavo.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from octavo.runtime.reasoning import ThinkingGate
    from octavo.runtime.pooling_params import PoolState
    from octavo.structured.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its KV blocks were freed: recompute later)
    RUNNING = "running"  # holds KV blocks; scheduled every step (prefill chunks, then decode)
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity equality/hash: requests are dict keys
class Request:
    request_id: str  # unique inside the engine ("id" or "id#i" for the i-th of n children)
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: np.random.Generator  # per-request RNG: same seed -> same tokens whatever the batch
    max_tokens: int  # params.max_tokens, capped so that prompt + output fits the context / pool
    arrival_order: int  # FCFS tie-break (monotonic counter)
    priority: int = 0  # lower value = served first (vLLM's convention)
    parent_id: str = ""  # the user's request id
    index: int = 0  # which of the n completions
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # physical block ids, in order
    block_hashes: list[bytes] = field(default_factory=list)  # chained hash of each FULL block so far
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_promised_blocks: int = 0  # its blocks before this index that are not registered yet may be promised
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    # first_scheduled_time is set on its first admission (num_cached_tokens too: the prefix-cache hits)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    prompt_logprobs_next: int = 0  # first prompt position whose logits row prompt_logprobs has not scored yet
    # requests the scheduler queues once this one has computed its prompt (or finished): the other n-1
    # children of an n > 1 request, which then find the prompt's full blocks in the prefix cache
    followers: list[Request] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # structured outputs: where the output is in its grammar
    # with a reasoning parser: whether the thinking has ended (the grammar waits for it; runtime/reasoning.py)
    thinking: ThinkingGate | None = None
    pool: PoolState | None = None  # an embedding request (SamplingParams.pooling): what it pooled so far
    lora_slot: int = 0  # the backend's LoRA slot of its adapter (0: the base model)
    cache_salt: bytes = b""  # seeds its prefix-cache hash chain: requests of different adapters never share KV
    # speculative decoding (the Scheduler writes both): the draft tokens scheduled after its last token this
    # step (verified by the target in the same step, then cleared by the commit), and how many it may propose
    # next (adapts to how many it had accepted; 0 = the config's num_speculative_tokens)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_limit: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token(self, position: int) -> int:
        """Token at absolute position (prompt first, then output)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(start - n, 0):end - n]
