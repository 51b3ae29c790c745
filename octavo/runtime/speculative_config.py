"""SpeculativeConfig: what `EngineArgs.speculative_config` (vLLM's `--speculative-config` JSON) asks for.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

    {"model": PATH, "num_speculative_tokens": 4}

`method` "ngram" is prompt lookup (runtime/ngram_proposer.py). As in vLLM, a missing prompt_lookup_min takes
prompt_lookup_max's value and the other way round, and both default to 5. `"model"` names a draft model (any
model argument: export folder, HF folder, .gguf, with the target's vocabulary; method "draft_model", as vLLM
infers it), run greedily by its own backend and KV pool (runtime/draft_proposer.py). `disable_by_batch_size`:
no request speculates in a step while more than this many requests run (vLLM's name; under load the batch
already uses the machine, and verifying drafts would only add work). On the onnxruntime backend it defaults
to CPU_DISABLE_BY_BATCH_SIZE (`with_cpu_default`): a CPU step of more than a few rows is compute-bound, so a
draft row costs about what a decode row does, and speculation could only lose throughput under load.
docs/engine.md, "Speculative decoding".
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from octavo.errors import InvalidRequestError

METHODS = ("ngram", "draft_model")
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size")
MAX_SPECULATIVE_TOKENS = 32  # drafts verified per request per step
MAX_LOOKUP = 64  # longest n-gram looked up
DEFAULT_LOOKUP = 5
CPU_DISABLE_BY_BATCH_SIZE = 4  # onnxruntime's default disable_by_batch_size


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model (method "draft_model")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """VALUE (a JSON object's text, a dict, or None/"" for no speculation) as a checked config;
        InvalidRequestError naming what is wrong."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"speculative_config must be a JSON object such as "
                                          f'{{"method": "ngram", "num_speculative_tokens": 4}}: {exc}') from None
        if not isinstance(value, Mapping):
            raise InvalidRequestError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                                      f"{', '.join(KEYS)}")
        method, model = value.get("method"), value.get("model")
        if method is None and model in ("ngram", "[ngram]"):  # vLLM's older spelling
            method, model = "ngram", None
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise InvalidRequestError(f"speculative_config: model must be a path or model name, got {model!r}")
        if method is None and model is not None:
            method = "draft_model"
        if (method == "draft_model") != (model is not None):
            raise InvalidRequestError('speculative_config: method "draft_model" and "model" (the draft model) go '
                                      "together")
        if method not in METHODS:
            raise InvalidRequestError(f"speculative_config: method must be one of {', '.join(METHODS)}, "
                                      f"got {method!r}")
        k = _int(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, required=True)
        hi = _int(value, "prompt_lookup_max", 1, MAX_LOOKUP)
        lo = _int(value, "prompt_lookup_min", 1, MAX_LOOKUP)
        if hi is None and lo is None:
            hi = lo = DEFAULT_LOOKUP
        hi, lo = hi if hi is not None else lo, lo if lo is not None else hi
        if lo > hi:
            raise InvalidRequestError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                                      f"({hi})")
        return cls(method, k, hi, lo, _int(value, "disable_by_batch_size", 1, 1 << 20), model)


def _int(value: Mapping[str, Any], key: str, lo: int, hi: int, required: bool = False) -> int | None:
    v = value.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidRequestError(f"speculative_config: {key} must be an integer from {lo} to {hi}, got {v!r}")
    return v


def with_cpu_default(config: SpeculativeConfig | None, backend: str) -> SpeculativeConfig | None:
    """CONFIG with disable_by_batch_size = CPU_DISABLE_BY_BATCH_SIZE on the onnxruntime backend when not given."""
    if config is None or config.disable_by_batch_size is not None or backend != "onnxruntime":
        return config
    return dataclasses.replace(config, disable_by_batch_size=CPU_DISABLE_BY_BATCH_SIZE)
