"""The engine's command-line flags, generated from EngineArgs: one flag per field, the same for every command
(generate, chat, serve, bench throughput, demo, triton) and the same words as Triton's config.pbtxt parameters.

A field `max_num_seqs` is the flag `--max-num-seqs`; a bool field `enable_prefix_caching` is the pair
`--enable-prefix-caching / --no-enable-prefix-caching` (as vLLM spells them), also when it may be None (`amx`:
`--amx / --no-amx`, neither = the field's default). Values are parsed by the Triton
parameters' converter (octavo/serving/engine_params.py), so `--kv-cache-memory 2G` and the parameter
`kv_cache_memory: "2G"` mean the same. A field added to EngineArgs gets its flag at once; HELP below gives it a
sentence (until then its help names the field). Earlier spellings stay accepted as aliases (ALIASES).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from octavo.errors import InvalidRequestError
from octavo.export.quant_options import QUANT_KERNEL_HELP, QUANT_KERNELS
from octavo.runtime.engine_args import (DECODE_ACTIVATIONS, ENVIRONMENT_DEFAULTS, ORT_SPINNING_MODES, PROMPT_ACTIVATIONS,
                                        EngineArgs)
from octavo.runtime.kv_dtype import KV_CACHE_DTYPES
from octavo.runtime.reasoning import REASONING_PARSERS
from octavo.serving.engine_params import convert_value, engine_parameter_names

HELP: dict[str, str] = {
    "block_size": "tokens per KV block (a power of two)",
    "num_blocks": "KV blocks in the pool (wins over --kv-cache-memory)",
    "kv_cache_memory": "KV pool size in bytes (e.g. 2G, 512M)",
    "max_num_seqs": "most sequences in one step's batch",
    "max_num_batched_tokens": "token budget of one step (longer prompts are prefilled in chunks)",
    "max_model_len": "context limit in tokens",
    "long_prefill_token_threshold": "prefill tokens per step that prompts with more than this many tokens left "
                                    "share, so a long prompt never holds back decodes and short prompts (0 = off)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes already computed",
    "num_threads": "backend threads",
    "backend": "onnxruntime (CPU) or tensorrt (NVIDIA GPU, after `octavo build`)",
    "seed": "seed of sampled requests that bring none",
    "trace_path": "write one JSON line per engine step here (draw it with `octavo trace FILE`)",
    "weights": "fp32, int8, int4 or gguf (a .gguf's own blocks): the weight format when exporting an HF folder / "
               ".gguf (own cache folder)",
    "quant_block_size": "with --weights int8/int4: values per scale / zero point (a power of two >= 16)",
    "quantize_lm_head": "with --weights int8/int4: quantize the LM head too",
    "quant_kernel": QUANT_KERNEL_HELP + " (own cache folder)",
    "max_constraint_bytes": "largest output constraint (JSON schema, grammar, regex, choices) in characters",
    "max_constraint_depth": "deepest nesting + $ref / rule-reference chain of an output constraint (at most 10000)",
    "max_constraint_rules": "most schema objects / grammar rules in an output constraint",
    "max_constraint_alternatives": "most branches of one anyOf / oneOf / grammar rule (at most 1900)",
    "max_constraint_choices": "most choices, or values of one enum, in an output constraint",
    "max_prompt_logprob_entries": "most prompt logprob entries (scored prompt tokens x (top-k + 1)) one request may "
                                  "ask for (prompt_logprobs, echo with logprobs)",
    "max_logprobs": "most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs); -1: the "
                    "whole vocabulary (vLLM's --max-logprobs)",
    "reasoning_parser": "a reasoning model's thinking markers (vLLM's names: deepseek_r1, qwen3, seed_oss, "
                        "minimax_m2): the server answers reasoning_content apart from content, and output "
                        "constraints apply to the answer after the thinking",
    "constraint_compile_timeout": "seconds a request waits for its output constraint to compile (then a 400)",
    "kv_events_config": "vLLM's KV events for KV-aware routers, as JSON: '{\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}' "
                        "(docs/serving.md)",
    "speculative_config": "speculative decoding, as vLLM's: a JSON object, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                          "(prompt lookup) or '{\"model\": PATH, \"num_speculative_tokens\": 4}' (a draft model; "
                          "docs/engine.md)",
    "kv_cache_dtype": "KV pool element type: auto (float16 for a GGUF's own quantized blocks, as llama.cpp; else float32), float32, float16 (half the memory), or int8 (onnxruntime: 8-bit codes + a float16 scale per head row, ~0.52x float16's memory)",
    "ort_fusions": "onnxruntime: fuse RoPE into ONNX Runtime's RotaryEmbedding and then into PagedAttention when "
                   "loading the graph (same logits, fewer nodes)",
    "ort_spinning": "onnxruntime: how its threads wait: run (spin during a step, stop after it), 0 (block), 1 (spin "
                    "always)",
    "prompt_activations": "onnxruntime, a GGUF's 4-bit blocks: a prompt step's activations in float32 (exact "
                          "weights x float32) or int8 (rounded per 32 values, as llama.cpp: faster prefill on AVX2; "
                          "decode steps unchanged)",
    "decode_activations": "onnxruntime, a GGUF's 4-bit, Q6_K and Q5_x blocks: the activations of decode, decode "
                          "batches and speculative verification rounded to int16 per block (default) or int8 per "
                          "32 values (as llama.cpp: faster decode on AVX2)",
    "amx": "the op library's AMX tiles where the CPU has them (off: what a CPU without AMX computes; one switch "
           "per process)",
}
# what a default of None means, for --help
NONE_MEANS: dict[str, str] = {
    "num_blocks": "from --kv-cache-memory",
    "kv_cache_memory": "enough for max-num-seqs full contexts, capped",
    "max_model_len": "the model's",
    "num_threads": "all cores",
    "trace_path": "none",
    "kv_events_config": "off",
    "speculative_config": "off",
    "weights": "gguf for a quantized .gguf, else fp32",
    "quant_kernel": "block",
    "quant_block_size": "32",
    "ort_fusions": f"on unless ${ENVIRONMENT_DEFAULTS['ort_fusions']} is 0",
    "ort_spinning": f"${ENVIRONMENT_DEFAULTS['ort_spinning']}, else run",
    "amx": f"on unless ${ENVIRONMENT_DEFAULTS['amx']} is 0",
}
METAVARS = {"trace_path": "FILE", "kv_cache_memory": "BYTES", "kv_events_config": "JSON", "speculative_config": "JSON"}
# the values EngineArgs.validate accepts for its plain-str fields (a Literal annotation gives its own)
CHOICES: dict[str, tuple[str, ...]] = {
    "backend": ("onnxruntime", "tensorrt"),
    "weights": ("fp32", "int8", "int4", "gguf"),
    "quant_kernel": QUANT_KERNELS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "prompt_activations": PROMPT_ACTIVATIONS,
    "decode_activations": DECODE_ACTIVATIONS,
    "ort_spinning": ORT_SPINNING_MODES,
    "reasoning_parser": tuple(REASONING_PARSERS),
}
ALIASES: dict[str, tuple[str, ...]] = {  # earlier spellings, still accepted
    "trace_path": ("--trace",),
    "seed": ("--engine-seed",),
    "num_threads": ("--threads",),
}
NEGATIVE_ALIASES = {"enable_prefix_caching": ("--no-prefix-caching",)}
ENGINE_FIELDS = engine_parameter_names()  # every EngineArgs field but model


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(name: str, default: Any) -> str:
    if default is None:
        return NONE_MEANS.get(name, "none")
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _parser_for(name: str):  # noqa: ANN202
    def parse(text: str) -> Any:
        try:
            return convert_value(name, text, flag_of(name))
        except InvalidRequestError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = name  # argparse names the type in "invalid <name> value"
    return parse


def _is_bool(annotation: Any) -> bool:
    """bool, or bool | None."""
    return annotation is bool or set(typing.get_args(annotation)) == {bool, type(None)}


def _choices(name: str, annotation: Any) -> tuple[Any, ...] | None:
    options = [a for a in typing.get_args(annotation) if a is not type(None)] if typing.get_args(annotation) \
        else [annotation]
    if len(options) == 1 and typing.get_origin(options[0]) is typing.Literal:
        return typing.get_args(options[0])
    return CHOICES.get(name)


def add_engine_arguments(parser: argparse.ArgumentParser, help_overrides: dict[str, str] | None = None) -> None:
    """One flag per EngineArgs field (not `model`), defaulting to the field's default. HELP_OVERRIDES: a command's
    own help (with its default) for some fields, e.g. the demo's computed pool size."""
    help_overrides = help_overrides or {}
    field_defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine (the same flags on every command; Triton parameters of the same names)")
    for name in ENGINE_FIELDS:
        default = field_defaults[name]
        what = HELP.get(name, f"engine argument {name}").replace("%", "%%")
        text = help_overrides.get(name) or f"{what} (default: {_default_text(name, default)})"
        if _is_bool(hints[name]):
            group.add_argument(flag_of(name), *ALIASES.get(name, ()), dest=name, default=default, help=text,
                               action=argparse.BooleanOptionalAction)
            for alias in NEGATIVE_ALIASES.get(name, ()):
                group.add_argument(alias, dest=name, action="store_false", help=argparse.SUPPRESS)
        else:
            choices = _choices(name, hints[name])
            group.add_argument(flag_of(name), *ALIASES.get(name, ()), dest=name, default=default, help=text,
                               type=_parser_for(name), choices=choices,
                               metavar=METAVARS.get(name, "{" + ",".join(map(str, choices)) + "}" if choices
                                                    else name.split("_")[-1].upper()))


def engine_args(args: argparse.Namespace, model: str | None = None) -> EngineArgs:
    """EngineArgs from the parsed flags (and MODEL, default args.model), validated."""
    values = {name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)}
    ea = EngineArgs(model=model if model is not None else args.model, **values)
    ea.validate()
    return ea


def changed_fields(ea: EngineArgs) -> dict[str, Any]:
    """The fields of EA that differ from EngineArgs' defaults (what `octavo triton` writes as parameters)."""
    return {f.name: getattr(ea, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name != "model" and getattr(ea, f.name) != f.default}
