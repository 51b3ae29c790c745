"""SamplingParams: what a request asks of the sampler and the stop logic (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

from octavo.errors import InvalidRequestError
from octavo.runtime.pooling_params import PoolingParams
from octavo.structured.params import StructuredOutputsParams


OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # vLLM's RequestOutputKind
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None = until the context is full
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # top-k logprobs per generated token (0 = only the chosen one; -1 = the whole vocabulary). The engine refuses
    # more than its EngineArgs.max_logprobs (vLLM's --max-logprobs)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (0 = only the prompt's own token; -1 = all)
    # vLLM's: the logprobs of exactly these tokens (besides the chosen one) at each generated position, instead of
    # the top-k; logprobs then defaults to (and must equal) their number
    logprob_token_ids: list[int] | None = None
    # vLLM's: only these tokens may be sampled (every other logit is -inf, before logit_bias and penalties)
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # what each output holds (vLLM's RequestOutputKind; see runtime/output_processor.py): "delta" (the
    # engine's native form: what is new since the previous output; the server and Triton stream these),
    # "cumulative" (everything so far, after every step that sampled for the request: O(length) copies),
    # "final_only" (one output, finished; LLM.generate asks for it)
    output_kind: str = "cumulative"
    # constrained decoding (JSON schema, regex, choice, grammar): vLLM's StructuredOutputsParams, or a dict of its fields
    structured_outputs: StructuredOutputsParams | None = None
    # beam search (vLLM's use_beam_search, runtime/beam_search.py): best_of (default n) beams, the n best
    # returned, ranked by cumulative logprob / length ** length_penalty; one final output
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    # an embedding request (runtime/pooling.py): the prompt is computed and pooled, nothing is sampled
    pooling: PoolingParams | None = None
    # the LoRA adapter this request runs with (a name of EngineArgs.lora_modules; None: the base model). The server
    # sets it from the request's `model`, LLM.generate from its lora_request (runtime/lora.py)
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logprob_token_ids, (list, tuple)) and self.logprobs is None:
            self.logprobs = len(self.logprob_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2 <= v <= 2:
                raise bad(f"{name} must be in [-2, 2], got {v!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):  # the upper bound is the engine's (max_logprobs)
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < -1):
                raise bad(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, got {v!r}")
        self._validate_token_lists()
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise bad(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        if not isinstance(self.use_beam_search, bool):
            raise bad(f"use_beam_search must be a boolean, got {self.use_beam_search!r}")
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            raise bad(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise bad("best_of different from n is only supported with use_beam_search (as the beam width)")
        if not _finite(self.length_penalty):
            raise bad(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.use_beam_search and (self.stop or self.stop_token_ids or self.logprobs is not None):
            raise bad("beam search ends hypotheses at EOS and max_tokens only: stop, stop_token_ids and "
                      "logprobs are not supported with use_beam_search")
        if self.use_beam_search and self.structured_outputs is not None:
            raise bad("structured outputs are not supported with use_beam_search (each beam would need its own "
                      "grammar state)")
        if self.lora_name is not None and not isinstance(self.lora_name, str):
            raise bad(f"lora_name must be a string, got {self.lora_name!r}")
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise bad(f"pooling must be a PoolingParams, got {type(self.pooling).__name__}")
        if self.pooling is not None and (self.use_beam_search or self.structured_outputs is not None
                                         or self.logprobs is not None or self.prompt_logprobs is not None):
            raise bad("an embedding request (pooling) samples nothing: beam search, structured outputs, logprobs "
                      "and prompt_logprobs do not apply")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                if not isinstance(k, int) or not _finite(v) or not -100 <= v <= 100:
                    raise bad(f"logit_bias maps token ids to values in [-100, 100], got {k!r}: {v!r}")

    def _validate_token_lists(self) -> None:
        """allowed_token_ids and logprob_token_ids: non-empty lists of token ids (the engine checks the vocabulary)."""
        for name in ("allowed_token_ids", "logprob_token_ids"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (list, tuple)) or not v or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
                raise InvalidRequestError(f"{name} must be a non-empty list of token ids, got {v!r}")
            setattr(self, name, list(v))
        ids = self.logprob_token_ids
        if ids is not None:
            if len(ids) > MAX_LOGPROB_TOKEN_IDS:
                raise InvalidRequestError(f"logprob_token_ids holds {len(ids)} token ids, more than the "
                                          f"{MAX_LOGPROB_TOKEN_IDS} allowed")
            if self.logprobs != len(ids):
                raise InvalidRequestError(f"when both logprobs and logprob_token_ids are set, logprobs must equal "
                                          f"len(logprob_token_ids): got logprobs={self.logprobs}, "
                                          f"len(logprob_token_ids)={len(ids)}")
            if self.use_beam_search:
                raise InvalidRequestError("logprob_token_ids is not supported with use_beam_search")
        if self.allowed_token_ids is not None and self.use_beam_search:  # (vLLM's beam search has no such field)
            raise InvalidRequestError("allowed_token_ids is not supported with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.use_beam_search

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


__all__ = ["SamplingParams", "StructuredOutputsParams", "field"]
