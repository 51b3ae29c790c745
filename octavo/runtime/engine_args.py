"""EngineArgs: every knob of the engine in one place (shared by LLM, AsyncEngine, CLI, server, Triton)."""
from __future__ import annotations

from dataclasses import dataclass

from octavo.errors import InvalidRequestError
from octavo.export.quant_options import (KERNEL_METHODS, check_quant_kernel, check_quant_options, check_weight_options,
                                         not_on_tensorrt)
from octavo.runtime.input_processor import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES
from octavo.runtime.kv_dtype import check_kv_cache_dtype
from octavo.structured.limits import ConstraintLimits

_LIMITS = ConstraintLimits()


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
        self.constraint_limits().validate()
        if isinstance(self.max_prompt_logprob_entries, bool) or not isinstance(self.max_prompt_logprob_entries, int) \
                or self.max_prompt_logprob_entries < 1:
            raise InvalidRequestError(f"max_prompt_logprob_entries must be an integer >= 1, got "
                                      f"{self.max_prompt_logprob_entries!r}")
        check_weight_options(self.weights, self.quant_block_size, self.quantize_lm_head)
        check_quant_kernel(self.quant_kernel)
        if self.weights is not None:  # None: known once the model is read (a quantized GGUF's default is "gguf")
            check_quant_options(self.weights, ["quant_kernel"] if self.quant_kernel is not None else [],
                                self.quant_kernel, subject="these engine arguments", spell=lambda option: option)
        if self.backend not in ("onnxruntime", "tensorrt"):
            raise InvalidRequestError(f"backend must be 'onnxruntime' or 'tensorrt', got {self.backend!r}")
        if self.backend == "tensorrt" and self.weights in ("int8", "int4", "gguf"):
            raise InvalidRequestError(not_on_tensorrt(f"weights={self.weights!r}: quantized weights",
                                                      list(dict.fromkeys(KERNEL_METHODS.values()))))
        if self.backend == "tensorrt" and self.quant_kernel is not None:
            raise InvalidRequestError(f"quant_kernel={self.quant_kernel!r} chooses the onnxruntime backend's kernel "
                                      "for quantized weights; tensorrt runs float weights only (leave it unset)")
