"""InputProcessor: a user's request in, a validated RequestGroup out (nothing queued, no engine state read).

Validation (the prompt's form and token ids, SamplingParams, priority, whether prompt + max_tokens can ever
fit the context and the KV pool), tokenization, the per-request RNG and the n > 1 fan-out. Safe from any
thread: AsyncEngine runs it on the caller's thread (or a worker) so that a bad request raises right there
and a long prompt never holds the engine loop. Its only state is the arrival counter (thread-safe under the
GIL), which orders requests first come, first served and seeds requests without a seed.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import numpy as np

from octavo.errors import InvalidRequestError, PromptTooLongError
from octavo.runtime.detokenizer import IncrementalDetokenizer
from octavo.runtime.output_processor import RequestGroup
from octavo.runtime.lora import LoRARegistry
from octavo.runtime.outputs import RequestMetrics
from octavo.runtime.pooling_params import EmbeddingModel, pool_state
from octavo.runtime.request import Request
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.tokenizer import Tokenizer
from octavo.runtime.structured_outputs import StructuredOutputManager

Prompt = str | list[int] | dict[str, Any]
# a request's prompt logprobs live as Python objects until its response is written (~200 bytes an entry, more
# as JSON): bounded per request, like the sampled tokens' logprobs are by max_tokens x 20
DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES = 65_536
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default: top-k per token a request may ask for


def _too_long(prompt_len: int, max_tokens: int, limit: int, what: str) -> tuple[str, str]:
    """(message, param) for prompt + max_tokens > LIMIT: the message says which of the two to change, and to what."""
    head = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds {what}"
    if prompt_len >= limit:  # no max_tokens can help
        return f"{head}; shorten the prompt to at most {limit - max_tokens} tokens", "prompt"
    return f"{head}; lower max_tokens to at most {limit - prompt_len}", "max_tokens"


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, num_blocks: int,
                 block_size: int, seed: int, structured: StructuredOutputManager | None = None,
                 beam_search_refusal: str | None = None, prompt_logprob_rows: int = 1,
                 max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 embedding_model: EmbeddingModel | None = None) -> None:
        """beam_search_refusal: why this engine cannot run beam search (None: it can). prompt_logprob_rows:
        the logits rows a step can return beyond one per sequence (0: prompt_logprobs is refused).
        embedding_model: what embedding requests (SamplingParams.pooling) can have (None: they are refused)."""
        self.tokenizer = tokenizer
        self.structured = structured  # compiles output constraints (None: a request with one is refused)
        self.beam_search_refusal = beam_search_refusal
        self.prompt_logprob_rows = prompt_logprob_rows
        self.max_prompt_logprob_entries = max_prompt_logprob_entries  # scored prompt tokens x (top-k + 1), at most
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs  # top-k per token (-1: the vocabulary)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seed = seed
        self.embedding_model = embedding_model or EmbeddingModel(None, 0)
        self.loras = LoRARegistry()  # the engine's adapters (runtime/lora.py); none until it sets them
        self._arrival_counter = itertools.count(1)

    def make_group(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                   arrival_time: float | None = None, priority: int = 0) -> RequestGroup:
        """Validate and tokenize a request; raises InvalidRequestError / PromptTooLongError."""
        request_id = str(request_id)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a private, normalised and validated copy
        text, ids = self._prompt_ids(prompt)
        pool = None
        if params.pooling is not None:  # computes the prompt only: fits as a one-token request
            pool = pool_state(self.embedding_model, params.pooling, params.max_tokens, params.n)
            params.max_tokens, params.min_tokens = 1, 0
        max_tokens = self._check_fits(len(ids), params)
        lora_slot, salt = 0, b""
        if params.lora_name is not None:
            lora_slot, salt = self.loras.slot(params.lora_name), self.loras.cache_salt(params.lora_name)
            if params.use_beam_search:
                raise InvalidRequestError("beam search with a LoRA adapter is not supported")
        if params.logit_bias and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        self._check_logprobs(params, max_tokens)
        if not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if params.use_beam_search and self.beam_search_refusal is not None:
            raise InvalidRequestError(self.beam_search_refusal)
        if params.prompt_logprobs is not None and (self.prompt_logprob_rows < 1 or params.use_beam_search):
            raise InvalidRequestError("prompt_logprobs is not supported with use_beam_search" if params.use_beam_search
                                      else "prompt_logprobs needs logits rows beyond one per sequence, and this "
                                      "backend returns no more (a TensorRT engine: rebuild it with a larger "
                                      "max_num_logits)")
        if params.prompt_logprobs is not None:
            entries = (len(ids) - 1) * (params.prompt_logprobs + 1)
            if entries > self.max_prompt_logprob_entries:
                raise InvalidRequestError(
                    f"prompt_logprobs={params.prompt_logprobs} on a {len(ids)}-token prompt is {entries} logprob entries; "
                    f"this server returns at most {self.max_prompt_logprob_entries} per request "
                    f"(--max-prompt-logprob-entries): ask for fewer top logprobs or score a shorter prompt")
        now = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            order = next(self._arrival_counter)
            children.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}", prompt_token_ids=ids,
                params=params, generator=self._generator(params, i, order), max_tokens=max_tokens,
                arrival_order=order, priority=priority, parent_id=request_id, index=i,
                metrics=RequestMetrics(arrival_time=now), pool=pool, lora_slot=lora_slot, cache_salt=salt))
        if params.structured_outputs is not None:  # compiled here, off the engine loop; each child its own matcher
            if self.structured is None:
                raise InvalidRequestError("structured outputs need an engine with a grammar compiler")
            self.structured.init_requests(children)
        # children 1..n-1 are queued once child 0 has computed the prompt: they then share its cached blocks
        children[0].followers = children[1:]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                         params.skip_special_tokens) for _ in children]
        return RequestGroup(request_id, text, ids, children, now, params.output_kind, detoks)

    def _check_logprobs(self, params: SamplingParams, max_tokens: int) -> None:
        """Resolve -1 (the whole vocabulary) in PARAMS (a private copy) and check every logprob ask against
        max_logprobs (vLLM's wording), the token-id lists against the vocabulary, and a sampled top-k beyond
        the default 20 against the per-request entry budget (its entries live until the response is written)."""
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            k = getattr(params, name)
            if k == -1:
                k = self.vocab_size
                setattr(params, name, k)
            if k is not None and k > self.max_logprobs:
                raise InvalidRequestError(f"Requested {what} logprobs of {k}, which is greater than max allowed: "
                                          f"{self.max_logprobs} (the server's --max-logprobs)")
        for name in ("allowed_token_ids", "logprob_token_ids"):
            outside = [t for t in getattr(params, name) or () if not 0 <= t < self.vocab_size]
            if outside:
                raise InvalidRequestError(f"{name} holds token ids out of vocabulary: {outside[:16]} "
                                          f"(vocabulary size {self.vocab_size}: allowed 0 to {self.vocab_size - 1})")
        if params.allowed_token_ids is not None:
            params.allowed_token_ids = sorted(set(params.allowed_token_ids))
        # a top-k above the default may hold no more entries than a top-20 request over the whole context does
        # (nor than max_prompt_logprob_entries, if that is more)
        k, budget = params.logprobs, max(self.max_prompt_logprob_entries, self.max_model_len * (DEFAULT_MAX_LOGPROBS + 1))
        if k is not None and k > DEFAULT_MAX_LOGPROBS and max_tokens * (k + 1) > budget:
            raise InvalidRequestError(
                f"logprobs={k} over up to {max_tokens} generated tokens is {max_tokens * (k + 1)} logprob entries; "
                f"this server keeps at most {budget} per request (a top-{DEFAULT_MAX_LOGPROBS} request over the "
                f"whole context, or --max-prompt-logprob-entries): lower max_tokens or the number of logprobs")

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
                raise InvalidRequestError("prompt_token_ids must be integers")
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        else:
            raise InvalidRequestError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return text, ids

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's effective max_tokens, or PromptTooLongError if it can never fit."""
        pool_tokens = self.num_blocks * self.block_size
        limit = min(self.max_model_len, pool_tokens + 1)  # the last sampled token needs no KV slot
        if params.max_tokens is None:
            if prompt_len >= limit:
                raise PromptTooLongError(
                    f"the prompt has {prompt_len} tokens; the limit is {limit - 1} "
                    f"(max_model_len {self.max_model_len}, KV pool {pool_tokens} tokens): shorten the prompt",
                    param="prompt")
            return limit - prompt_len
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(*_too_long(prompt_len, params.max_tokens, self.max_model_len,
                                                f"the model's context of {self.max_model_len} tokens"))
        if total > pool_tokens + 1:
            where = (f"the whole pool of KV blocks ({self.num_blocks} blocks of {self.block_size} = {pool_tokens} tokens; "
                     "a bigger pool: num_blocks / kv_cache_memory)")
            raise PromptTooLongError(*_too_long(prompt_len, params.max_tokens, pool_tokens + 1, where))
        return params.max_tokens

    def _generator(self, params: SamplingParams, index: int, order: int) -> np.random.Generator:
        if params.seed is None:
            return np.random.default_rng([self.seed % (1 << 64), order])
        seed = params.seed % (1 << 64)
        return np.random.default_rng(seed if index == 0 else [seed, index])
