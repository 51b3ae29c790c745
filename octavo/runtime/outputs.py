"""What a request returns: RequestOutput with CompletionOutputs and metrics (vLLM's shape).

With SamplingParams.output_kind="delta" (the engine's native form) a CompletionOutput's text, token_ids
and logprobs hold only what is new since the previous output of that completion, and finish_reason is
set once, on its last one; see runtime/output_processor.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    decoded: str = ""
    rank: int | None = None  # 1 = the most likely token at its position (prompt logprobs carry it, as vLLM's)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: top-k + the chosen one
    error: str | None = None  # message when finish_reason == "error"
    cumulative_logprob: float | None = None  # beam search: the hypothesis' summed token logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt position, None first (no context), then {token_id: Logprob}
    # holding the top-k and the prompt's own token (vLLM's shape); None when not asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # an embedding request (SamplingParams.pooling): its vector, float32, on the final output; None otherwise
    embedding: np.ndarray | None = None
