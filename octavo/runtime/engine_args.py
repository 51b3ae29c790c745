"""EngineArgs: every knob of the engine in one place (shared by LLM, AsyncEngine, CLI, server, Triton).

Three knobs of the onnxruntime backend also have a default in the environment (ENVIRONMENT_DEFAULTS): a field
left None takes it in `with_environment_defaults`, the one place octavo reads those variables; the backend and
the op library are then told the explicit value.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from octavo.errors import InvalidRequestError
from octavo.export.quant_options import (KERNEL_METHODS, check_quant_kernel, check_quant_options, check_weight_options,
                                         not_on_tensorrt)
from octavo.runtime.input_processor import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES
from octavo.runtime.kv_dtype import check_kv_cache_dtype
from octavo.runtime.reasoning import get_reasoning_format
from octavo.runtime.kv_events import KVEventsConfig
from octavo.runtime.speculative_config import SpeculativeConfig
from octavo.structured.limits import ConstraintLimits

_LIMITS = ConstraintLimits()

# how ONNX Runtime's intra-op threads wait (octavo/runtime/backends/onnxruntime.py's docstring): spin during a step
# and stop when it returns, block between parallel sections, or spin always
ORT_SPINNING_MODES = ("run", "0", "1")
# field -> the environment variable that gives its default while the field is None (docs/engine.md)
ENVIRONMENT_DEFAULTS = {"ort_fusions": "OCTAVO_ORT_FUSIONS", "ort_spinning": "OCTAVO_ORT_SPINNING", "amx": "OCTAVO_AMX"}


PROMPT_ACTIVATIONS = ("float32", "int8")  # EngineArgs.prompt_activations
DECODE_ACTIVATIONS = ("int16", "int8")  # EngineArgs.decode_activations
ACTIVATIONS = {"prompt_activations": PROMPT_ACTIVATIONS, "decode_activations": DECODE_ACTIVATIONS}  # first: default


def check_activations(field: str, value: str, backend: str = "onnxruntime") -> None:
    """FIELD (a key of ACTIVATIONS) = VALUE is one of its choices, and other than its default only on onnxruntime."""
    choices = ACTIVATIONS[field]
    if value not in choices:
        raise InvalidRequestError(f"{field} must be one of {choices}, got {value!r}")
    if value != choices[0] and backend != "onnxruntime":
        raise InvalidRequestError(f"{field} applies to the onnxruntime backend's octavo.BlockMatMul only, not to "
                                  f"backend {backend!r}")

@dataclass(slots=True)
class EngineArgs:
    model: str  # export folder, HF folder or .gguf (the latter two are exported into a cache dir)
    block_size: int = 16
    num_blocks: int | None = None  # wins over kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool; default: enough for max_num_seqs full contexts, capped
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # prefill tokens per step that requests with more than this many tokens left to compute take TOGETHER
    # (vLLM's long_prefill_token_threshold, shared): a long prompt is prefilled in chunks of at most this
    # beside the decodes and short prompts, which keep the rest of the budget (docs/engine.md); 0 = off
    long_prefill_token_threshold: int = 512
    max_model_len: int | None = None  # default: the manifest's max_context
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # backend intra-op threads; None = all cores
    backend: str = "onnxruntime"  # "onnxruntime" | "tensorrt"
    seed: int = 0  # default seed for requests without one
    trace_path: str | None = None  # write one JSON line per step here
    # "fp32" | "int8" | "int4" | "gguf": format when exporting HF/GGUF (None: a quantized GGUF's own blocks, else
    # fp32); must match an export folder
    weights: str | None = None
    quant_block_size: int | None = None  # int8/int4 only: values per scale, a power of two >= 16 (None = the exporter's 32)
    quantize_lm_head: bool = False  # int8/int4 only: quantize the vocabulary projection too (docs/quantization.md)
    # quantized weights (gguf, int8, int4) only: "block" (octavo.BlockMatMul) or "matmulnbits" (ONNX Runtime's
    # MatMulNBits at accuracy_level 4); None = "block". Part of the cache folder's name; must match an export folder
    quant_kernel: str | None = None
    kv_cache_dtype: str = "auto"  # "auto" (float16 for a GGUF's own blocks, else float32: runtime/kv_dtype.py) | "float32" | "float16"
    # how large an output constraint (JSON schema, regex, choice, grammar) may be: checked before it is compiled
    # (octavo/structured/limits.py, docs/security.md); past a limit the request gets a 400 naming it
    max_constraint_bytes: int = _LIMITS.max_bytes  # characters of the schema / grammar / regex / choices
    max_constraint_depth: int = _LIMITS.max_depth  # nesting + $ref / rule-reference chains (at most 10,000)
    max_constraint_rules: int = _LIMITS.max_rules  # schema objects / grammar rules
    max_constraint_alternatives: int = _LIMITS.max_alternatives  # of one anyOf / oneOf / rule (at most 1,900)
    max_constraint_choices: int = _LIMITS.max_choices  # choice entries, values of one enum
    constraint_compile_timeout: float = _LIMITS.compile_timeout  # seconds a request waits for its grammar
    # prompt_logprobs / echo + logprobs: scored prompt tokens x (top-k + 1) one request may ask for (a 400 past it)
    max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES
    # vLLM's --max-logprobs: the most top logprobs (logprobs, top_logprobs, prompt_logprobs) a request may ask for;
    # -1 = the whole vocabulary (entries per request still bounded by max_prompt_logprob_entries)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # a reasoning model's thinking markers (vLLM's --reasoning-parser names: runtime/reasoning.py): output
    # constraints start after the thinking; the server splits reasoning_content from content
    reasoning_parser: str | None = None
    # vLLM's --kv-events-config (JSON): publish the prefix cache's stored / removed / cleared blocks over ZeroMQ for
    # KV-aware routers (runtime/kv_events.py, docs/serving.md); None = off
    kv_events_config: str | None = None
    # LoRA adapters (runtime/lora.py, docs/serving.md "LoRA"): "name=PEFT_DIR,name2=DIR2", served beside the base
    # model; max_loras adapters at once (slots), each of rank <= max_lora_rank; onnxruntime, float32 exports
    lora_modules: str | None = None
    enable_lora: bool = False  # LoRA slots even without lora_modules (adapters loaded later: load_lora_adapter)
    max_loras: int = 4
    max_lora_rank: int = 16
    # speculative decoding, vLLM's --speculative-config: a JSON object such as '{"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}' or '{"model": PATH,
    # "num_speculative_tokens": 4}' (a draft model); LLM(...) also takes the dict; None = off. runtime/speculative_config.py, docs/engine.md "Speculative decoding"
    speculative_config: str | None = None

    # the onnxruntime backend's knobs (docs/engine.md); None = the environment's default (with_environment_defaults)
    # the graph rewritten at load (RoPE into RotaryEmbedding, then into PagedAttention: docs/op.md); None = on
    # unless $OCTAVO_ORT_FUSIONS is "0"
    ort_fusions: bool | None = None
    ort_spinning: str | None = None  # ORT_SPINNING_MODES; None = $OCTAVO_ORT_SPINNING, else "run"
    # the op library's AMX tiles where the CPU has them (off: what a CPU without AMX computes; one switch per
    # process, set by the last backend made); None = on unless $OCTAVO_AMX is "0"
    amx: bool | None = None
    # the arithmetic of octavo.BlockMatMul's prompt (and mixed) steps on 4-bit blocks: "float32" (x times the
    # file's exact weights) or "int8" (x rounded to int8 per 32 values, as llama.cpp multiplies a quantized file:
    # faster prefill on AVX2; docs/quantization.md). Decode steps keep their 16-bit path either way.
    prompt_activations: str = "float32"
    # the same for the steps octavo.BlockMatMul (and octavo.MoE) run on their 16-bit path (decode, decode batches,
    # speculative verification, any step of at most 8 tokens): "int16" (x rounded to 16 bits per block, 2^-16 of
    # its largest value) or "int8" (as above: fewer instructions a weight, faster decode and verification on AVX2;
    # docs/quantization.md). Both keep a row's bits independent of its batch, so speculation stays exact to it.
    decode_activations: str = "int16"

    def kv_events(self) -> KVEventsConfig:
        """kv_events_config parsed (events off when it is None)."""
        return KVEventsConfig.parse(self.kv_events_config) if self.kv_events_config is not None else KVEventsConfig()

    def constraint_limits(self) -> ConstraintLimits:
        return ConstraintLimits(self.max_constraint_bytes, self.max_constraint_depth, self.max_constraint_rules,
                                self.max_constraint_alternatives, self.max_constraint_choices,
                                self.constraint_compile_timeout)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise InvalidRequestError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise InvalidRequestError(f"long_prefill_token_threshold must be an integer >= 0 (0 = off), got "
                                      f"{self.long_prefill_token_threshold!r}")
        if self.weights not in (None, "fp32", "int8", "int4", "gguf"):
            raise InvalidRequestError(f"weights must be 'fp32', 'int8', 'int4' or 'gguf', got {self.weights!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        for field in ACTIVATIONS:
            check_activations(field, getattr(self, field), self.backend)
        self.constraint_limits().validate()
        if isinstance(self.max_prompt_logprob_entries, bool) or not isinstance(self.max_prompt_logprob_entries, int) \
                or self.max_prompt_logprob_entries < 1:
            raise InvalidRequestError(f"max_prompt_logprob_entries must be an integer >= 1, got "
                                      f"{self.max_prompt_logprob_entries!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise InvalidRequestError(f"max_logprobs must be an integer >= 0, or -1 for the whole vocabulary, got "
                                      f"{self.max_logprobs!r}")
        if self.reasoning_parser is not None:
            get_reasoning_format(self.reasoning_parser)
        if self.kv_events_config is not None:
            KVEventsConfig.parse(self.kv_events_config)
        SpeculativeConfig.parse(self.speculative_config)
        check_weight_options(self.weights, self.quant_block_size, self.quantize_lm_head)
        check_quant_kernel(self.quant_kernel)
        if self.weights is not None:  # None: known once the model is read (a quantized GGUF's default is "gguf")
            check_quant_options(self.weights, ["quant_kernel"] if self.quant_kernel is not None else [],
                                self.quant_kernel, subject="these engine arguments", spell=lambda option: option)
        if self.ort_spinning is not None and self.ort_spinning not in ORT_SPINNING_MODES:
            raise InvalidRequestError(f"ort_spinning must be one of {', '.join(ORT_SPINNING_MODES)}, got "
                                      f"{self.ort_spinning!r}")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or not 1 <= self.max_loras <= 64:
            raise InvalidRequestError(f"max_loras must be an integer between 1 and 64, got {self.max_loras!r}")
        if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) \
                or not 1 <= self.max_lora_rank <= 512:
            raise InvalidRequestError(f"max_lora_rank must be an integer between 1 and 512, got {self.max_lora_rank!r}")
        if (self.lora_modules or self.enable_lora) and self.backend != "onnxruntime":
            raise InvalidRequestError("LoRA adapters (lora_modules, enable_lora) need the onnxruntime backend")
        if self.backend not in ("onnxruntime", "tensorrt"):
            raise InvalidRequestError(f"backend must be 'onnxruntime' or 'tensorrt', got {self.backend!r}")
        if self.backend == "tensorrt" and self.weights in ("int8", "int4", "gguf"):
            raise InvalidRequestError(not_on_tensorrt(f"weights={self.weights!r}: quantized weights",
                                                      list(dict.fromkeys(KERNEL_METHODS.values()))))
        if self.backend == "tensorrt" and self.quant_kernel is not None:
            raise InvalidRequestError(f"quant_kernel={self.quant_kernel!r} chooses the onnxruntime backend's kernel "
                                      "for quantized weights; tensorrt runs float weights only (leave it unset)")

    def with_environment_defaults(self, environ: Mapping[str, str] | None = None) -> EngineArgs:
        """These arguments with every field of ENVIRONMENT_DEFAULTS that is None set from ENVIRON (default
        os.environ): the one place octavo reads OCTAVO_ORT_FUSIONS, OCTAVO_ORT_SPINNING and OCTAVO_AMX. Fields
        already set stay; unset variables give the built-in defaults (fusions on, spinning "run", AMX on)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        if self.ort_fusions is None:
            values["ort_fusions"] = environ.get(ENVIRONMENT_DEFAULTS["ort_fusions"], "1") != "0"
        if self.ort_spinning is None:
            name = ENVIRONMENT_DEFAULTS["ort_spinning"]
            spinning = environ.get(name, "run")
            if spinning not in ORT_SPINNING_MODES:
                raise InvalidRequestError(f"{name} must be one of {ORT_SPINNING_MODES}, got {spinning!r}")
            values["ort_spinning"] = spinning
        if self.amx is None:
            values["amx"] = environ.get(ENVIRONMENT_DEFAULTS["amx"]) != "0"
        return dataclasses.replace(self, **values) if values else self
