"""Model setup for an LLMEngine: which export folder to load, how large the KV pool is, and which backend runs it.

Kept apart from the step loop: it runs once, reads /proc/meminfo and the export's manifest, and knows the
TensorRT rules (fp32 weights only; the pool dtype is fixed at build time).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from octavo.errors import InvalidRequestError
from octavo.export.manifest import MANIFEST_NAME, Manifest
from octavo.export.moe_spec import moe_not_on_tensorrt
from octavo.export.quant_options import methods_of, not_on_tensorrt
from octavo.runtime.backends.base import Backend
from octavo.runtime.backends.longrope_table import wanted_factors
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.kv_dtype import resolve_kv_cache_dtype
from octavo.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_POOL_CONTEXT = 4096  # default pool: max_num_seqs sequences of min(max_model_len, this) tokens
DEFAULT_POOL_CAP = 2 << 30  # ... but at most this many bytes and a quarter of the available memory


@dataclass(slots=True)
class LoadedModel:
    """What the engine runs: the export, its tokenizer, the context it serves and the backend."""

    model_dir: Path
    manifest: Manifest
    tokenizer: Tokenizer
    max_model_len: int
    backend: Backend


def load_model(args: EngineArgs, backend: Backend | None = None) -> LoadedModel:
    """Resolve args.model to an export, check the engine arguments against it and make the backend
    (or check the one given: tests and fault injection pass their own). Fields left to the environment
    (EngineArgs.with_environment_defaults) are read here, once."""
    args = args.with_environment_defaults()
    weights = args.weights
    if weights is None and args.backend == "tensorrt" and not (Path(args.model) / MANIFEST_NAME).is_file():
        weights = "fp32"  # TensorRT runs float weights only: a quantized GGUF is dequantized for it
    model_dir = resolve_model_dir(args.model, weights, args.quant_block_size, args.quantize_lm_head, args.quant_kernel)
    manifest = Manifest.load(model_dir)
    warn_without_bf16(manifest, bool(args.amx))
    if args.backend == "tensorrt" and manifest.weights != "fp32":  # before any TensorRT import
        raise InvalidRequestError(not_on_tensorrt(f"{model_dir} holds {manifest.weights} weights, which",
                                                  methods_of(manifest.quantization)))
    if args.backend == "tensorrt" and manifest.moe is not None:
        raise InvalidRequestError(moe_not_on_tensorrt(str(model_dir)))
    tokenizer = Tokenizer(model_dir, manifest)
    if args.max_model_len is not None and not 1 <= args.max_model_len <= manifest.max_context:
        raise InvalidRequestError(f"max_model_len must be in [1, {manifest.max_context}] (the model's "
                                  f"context), got {args.max_model_len}")
    max_model_len = args.max_model_len or manifest.max_context
    if backend is None:
        backend = make_backend(args, model_dir, manifest, max_model_len)
    elif backend.block_size != args.block_size:
        raise InvalidRequestError(f"backend block_size {backend.block_size} != EngineArgs.block_size {args.block_size}")
    return LoadedModel(model_dir, manifest, tokenizer, max_model_len, backend)


def warn_without_bf16(manifest: Manifest, amx: bool = True) -> None:
    """An export whose prompt steps may run in bfloat16 (--quant-kernel block-bf16) on a CPU without AVX512-BF16
    (AMX tiles where the CPU has AMX-BF16 and AMX is on, VDPBF16PS vectors elsewhere): its nodes fall back to
    float32 (same results as block, none of the speed), which the user should know."""
    if (manifest.quantization or {}).get("prompt_arithmetic") != "bfloat16":
        return
    from octavo.runtime.backends.op_variants import cpu_flags

    flags = cpu_flags() or frozenset()
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        logger.warning("this export asks for bfloat16 prompt steps (quant_kernel 'block-bf16'), but this CPU has "
                       "no AVX512-BF16: they run in float32, as with 'block'")
    elif not amx and {"amx_bf16", "amx_tile"} <= flags:
        logger.info("amx off: this export's bfloat16 prompt steps run on AVX512-BF16 vectors, not AMX tiles")


def resolve_model_dir(model: str | Path, weights: str | None = None, quant_block_size: int | None = None,
                      quantize_lm_head: bool = False, quant_kernel: str | None = None) -> Path:
    """An export folder as is (checked against WEIGHTS / QUANT_KERNEL when they are named); anything else (HF
    folder, .gguf) is exported once into the cache (with WEIGHTS int8/int4 or QUANT_KERNEL: that variant, in its
    own cache folder)."""
    path = Path(model)
    if (path / MANIFEST_NAME).is_file() and weights is None and quant_kernel is None:
        return path
    from octavo.export.resolve import resolve_model

    return Path(resolve_model(path, weights=weights, quant_block_size=quant_block_size,
                              quantize_lm_head=quantize_lm_head, quant_kernel=quant_kernel))


def default_num_blocks(args: EngineArgs, manifest: Manifest, max_model_len: int, kv_dtype: str | None = None) -> int:
    """KV pool size: num_blocks wins; else kv_cache_memory bytes; else the documented default.
    kv_dtype: the pool's element type (None: what args.kv_cache_dtype resolves to for this manifest)."""
    kv_dtype = kv_dtype or resolve_kv_cache_dtype(args.kv_cache_dtype, manifest)
    per_block = manifest.kv_bytes_per_block(args.block_size, kv_dtype)
    if args.num_blocks is not None:
        return args.num_blocks
    if args.kv_cache_memory is not None:
        n = int(args.kv_cache_memory) // per_block
        if n < 1:
            raise InvalidRequestError(
                f"kv_cache_memory={args.kv_cache_memory} bytes is less than one KV block ({per_block} bytes "
                f"of {kv_dtype})")
        return n
    want = args.max_num_seqs * -(-min(max_model_len, DEFAULT_POOL_CONTEXT) // args.block_size)
    cap = min(DEFAULT_POOL_CAP, _available_memory() // 4) // per_block
    one_context = -(-max_model_len // args.block_size)
    return max(min(want, cap), min(one_context, want), 1)


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def make_backend(args: EngineArgs, model_dir: Path, manifest: Manifest, max_model_len: int) -> Backend:
    if args.backend == "tensorrt":  # sizes its pool from free GPU memory unless told
        from octavo.tensorrt.backend import TensorRTBackend
        from octavo.tensorrt.engine_info import BUILD_INFO_NAME, BuildInfo, check_serving_limits

        # The pool dtype is the engine's, fixed at build time. Without an engine the backend itself says
        # what is missing (TensorRT, or the engine), so sizing falls back to the manifest's dtype.
        if args.kv_cache_dtype == "int8":
            raise InvalidRequestError("kv_cache_dtype='int8' runs on the onnxruntime backend only: the TensorRT "
                                      "plugin keeps float32, float16 or bfloat16 pools (`octavo build --dtype`)")
        built = (model_dir / BUILD_INFO_NAME).is_file()
        pool_dtype = BuildInfo.load(model_dir).dtype if built else manifest.dtype
        if built and args.kv_cache_dtype not in ("auto", pool_dtype):
            raise InvalidRequestError(
                f"this TensorRT engine keeps its KV pool in {pool_dtype} (set by `octavo build --dtype`); "
                f"kv_cache_dtype={args.kv_cache_dtype!r} needs an engine built for it, or use 'auto'")
        if built:  # options the engine's profile cannot run fail here, not at the first step past them
            check_serving_limits(BuildInfo.load(model_dir), model_dir, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len)
        explicit = args.num_blocks is not None or args.kv_cache_memory is not None
        num_blocks = default_num_blocks(args, manifest, max_model_len, pool_dtype) if explicit else None
        want = wanted_factors(manifest.rope_scaling, max_model_len)
        if want is not None and want != manifest.rope_scaling.get("factors"):  # type: ignore[union-attr]
            logger.warning("this TensorRT engine rotates with the export's %s longrope factors; max_model_len %d "
                        "calls for the %s ones (the ONNX Runtime backend switches them)",
                        manifest.rope_scaling.get("factors"), max_model_len, want)  # type: ignore[union-attr]
        return TensorRTBackend(model_dir, manifest, num_blocks, args.block_size)
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, manifest)
    args = args.with_environment_defaults()  # a no-op from load_model; make_backend is also called alone
    return OnnxRuntimeBackend(model_dir, manifest, default_num_blocks(args, manifest, max_model_len, kv_dtype),
                              args.block_size, num_threads=args.num_threads, kv_cache_dtype=kv_dtype,
                              ort_fusions=bool(args.ort_fusions), ort_spinning=str(args.ort_spinning),
                              amx=bool(args.amx), max_model_len=max_model_len,
                              prompt_activations=args.prompt_activations,
                              decode_activations=args.decode_activations,
                              lora=(args.max_loras, args.max_lora_rank) if args.lora_modules or args.enable_lora
                              else None)
