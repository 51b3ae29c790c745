"""Which quantization options apply to which weights: one rule for `octavo export` and for the engine
(`octavo serve|generate|chat|bench|demo|triton --weights ...`, `LLM(..., weights=...)`), so an option that would
change nothing is refused the same way wherever it is given, rather than silently ignored.

Kept free of numpy (octavo.export.quantize imports it): every `octavo` command line builds its parser from these
names, and EngineArgs.validate checks against them.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from octavo.errors import InvalidRequestError

# how quantized weights (int8, int4, gguf) are multiplied: "block" = octavo.BlockMatMul (the default: 16-bit
# activations for decode steps, float32 for a prompt's steps; plugins/onnxruntime/block_matmul_kernel.h);
# "matmulnbits" = ONNX Runtime's MatMulNBits at accuracy_level (int8 activations at 4; gguf adds the residual)
# "block-bf16" = octavo.BlockMatMul whose prompt steps (and PagedAttention's) compute in bfloat16 with float32
# sums on CPUs with AMX-BF16 (plugins/onnxruntime/amx.h), float32 elsewhere: decode steps are block's
QUANT_KERNELS = ("block", "block-bf16", "matmulnbits")
BLOCK_KERNELS = ("block", "block-bf16")
DEFAULT_QUANT_KERNEL = "block"
RESIDUAL_ROWS = 64  # see QuantConfig.residual_rows
# the manifest's quantization "method" of each kernel
KERNEL_METHODS = {"block": "BlockMatMul", "block-bf16": "BlockMatMul", "matmulnbits": "MatMulNBits"}
# --quant-kernel's help, the same on `octavo export` and on the engine's commands (serve, generate, bench, ...)
QUANT_KERNEL_HELP = ("quantized weights (gguf, int8, int4): block (default; octavo.BlockMatMul: activations rounded to "
                     "16 bits per block for steps of <= 8 tokens, float32 on the exact weight values for larger "
                     "ones), block-bf16 (block, but prompt steps, and their attention, in bfloat16 with float32 "
                     "sums on CPUs with AMX-BF16, ~3x faster prompts; float32 elsewhere) or matmulnbits (ONNX "
                     "Runtime's MatMulNBits: int8 activations at accuracy level 4, the "
                     f"default; for gguf their rounding is undone in steps of <= {RESIDUAL_ROWS} tokens)")
OPTIONS = ("quant_block_size", "quantize_lm_head", "quant_kernel", "accuracy_level", "residual_rows")


def flag(option: str) -> str:
    """The command-line spelling of OPTION: quant_kernel -> --quant-kernel."""
    return "--" + option.replace("_", "-")


def check_quant_kernel(kernel: object) -> None:
    if kernel is not None and kernel not in QUANT_KERNELS:
        raise InvalidRequestError(f"quant_kernel must be one of {', '.join(map(repr, QUANT_KERNELS))} "
                                  f"(None = {DEFAULT_QUANT_KERNEL!r}), got {kernel!r}")


def check_quant_block_size(block_size: int) -> None:
    """Values per scale of int8/int4 weights: a power of two >= 16 (InvalidRequestError otherwise)."""
    if block_size < 16 or block_size & (block_size - 1):
        raise InvalidRequestError(f"quant_block_size must be a power of two >= 16, got {block_size}")


def check_weight_options(weights: str | None, quant_block_size: int | None, quantize_lm_head: bool) -> None:
    """quant_block_size (a power of two >= 16) and quantize_lm_head are for --weights int8|int4 only: the one
    check EngineArgs.validate and the exporter's resolve both make (InvalidRequestError)."""
    if quant_block_size is not None:
        check_quant_block_size(quant_block_size)
    if (quant_block_size is not None or quantize_lm_head) and weights not in ("int8", "int4"):
        raise InvalidRequestError(f"quant_block_size / quantize_lm_head apply to quantized weights only; pass "
                                  f"weights='int8' or 'int4' with them (got weights={weights!r})")


def unused_options(weights: str, given: Collection[str], kernel: str | None) -> list[str]:
    """The options of GIVEN (names from OPTIONS) that would change nothing for WEIGHTS ("fp32" | "int8" | "int4" |
    "gguf") multiplied by KERNEL (None: the default), in OPTIONS order."""
    unknown = set(given) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown quantization options {sorted(unknown)}")
    kernel = kernel or DEFAULT_QUANT_KERNEL
    quantized = weights != "fp32"
    applies = {
        "quant_block_size": weights in ("int8", "int4"),
        "quantize_lm_head": weights in ("int8", "int4"),
        "quant_kernel": quantized,
        # with the block kernel, int8/int4 layers whose K is not a multiple of the block stay MatMulNBits
        "accuracy_level": quantized and not (weights == "gguf" and kernel in BLOCK_KERNELS),
        "residual_rows": weights == "gguf" and kernel == "matmulnbits",
    }
    return [option for option in OPTIONS if option in given and not applies[option]]


def check_quant_options(weights: str, given: Collection[str], kernel: str | None, *, subject: str = "this export",
                        spell: Callable[[str], str] = flag) -> None:
    """Refuse (InvalidRequestError) the options of GIVEN that would change nothing for WEIGHTS and KERNEL.
    SUBJECT names what they were given for; SPELL writes an option's name the way the caller gave it."""
    unused = unused_options(weights, given, kernel)
    if not unused:
        return
    kernel = kernel or DEFAULT_QUANT_KERNEL
    s = spell
    raise InvalidRequestError(
        f"{', '.join(map(s, unused))} would change nothing for {subject} (weights {weights}"
        f"{', kernel ' + kernel if weights != 'fp32' else ''}): {s('quant_block_size')} and {s('quantize_lm_head')} "
        f"apply to {s('weights')} int8|int4, {s('quant_kernel')} to quantized weights, {s('accuracy_level')} to "
        f"MatMulNBits ({s('quant_kernel')} matmulnbits), {s('residual_rows')} to {s('weights')} gguf "
        f"{s('quant_kernel')} matmulnbits (docs/quantization.md)")


TENSORRT_FP32_HOWTO = "export with --weights fp32 (weights='fp32') for the TensorRT path"


def not_on_tensorrt(subject: str, ops: Sequence[str]) -> str:
    """The one wording of "quantized weights do not run on TensorRT", for every place that refuses them before
    TensorRT is touched (engine arguments, a loaded export, the engine builder, the ONNX prepared for TensorRT):
    SUBJECT (what was asked for) runs on ONNX Runtime only, OPS (the graph's quantized matmul ops) have no
    TensorRT plugin, and the way out."""
    names = " and ".join(f"octavo.{op}" if op == KERNEL_METHODS["block"] else op for op in ops)
    return (f"{subject} run on ONNX Runtime only ({names} {'have' if len(ops) > 1 else 'has'} no TensorRT "
            f"plugin); {TENSORRT_FP32_HOWTO}")


def methods_of(quantization: Mapping[str, Any] | None) -> list[str]:
    """The matmul ops a manifest's `quantization` entry says the graph runs: its "method" (MatMulNBits for
    exports older than the key), then the "fallback_method" of layers the block kernel could not take."""
    quantization = quantization or {}
    methods = [str(quantization.get("method", KERNEL_METHODS["matmulnbits"]))]
    fallback = quantization.get("fallback_method")
    if quantization.get("fallback_layers") and fallback and fallback not in methods:
        methods.append(str(fallback))
    return methods
