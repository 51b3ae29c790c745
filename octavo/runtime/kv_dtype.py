"""KV cache element types: what `EngineArgs.kv_cache_dtype` accepts and which dtype a pool then holds.
Bytes per block: Manifest.kv_bytes_per_block; the onnxruntime pools: backends/ort_kv_pools.py.

`EngineArgs.kv_cache_dtype` is "auto", "float32", "float16" (half the bytes per block; the activations
stay float32 and the op converts K/V on write and on read) or "int8" (onnxruntime only: each token's K and V
row of each kv head as 8-bit codes with its own float16 scale, head_dim + 2 bytes a row: 0.52x float16's
bytes at head_dim 64, 0.51x at 128; the op quantizes on write and dequantizes exactly on read, all
arithmetic float32; plugins/onnxruntime/kv_int8.h; accuracy against float16 KV: docs/engine.md).
What "auto" picks:

| export                                             | "auto" pool | why                                        |
| ---                                                | ---         | ---                                        |
| a GGUF file's own quantized blocks (weights "gguf") | float16     | llama.cpp's default K/V type for the same file; half the bytes each batched decode step reads (docs/performance-log.md) |
| anything else (fp32, int8, int4; HF or GGUF)        | the manifest's dtype (float32 on onnxruntime) | the exactness tests against transformers |

"float32" asks for the manifest's float32 pools whatever the weights (on SmolLM2's GGUF an fp16 history moved
chosen-token logprobs by <= 0.0067 over 10 x 128 greedy tokens, none of them changed: docs/performance-log.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from octavo.errors import InvalidRequestError
from octavo.export.manifest import KV_ITEMSIZE
from octavo.export.quantize import GGUF_NATIVE

if TYPE_CHECKING:
    from octavo.export.manifest import Manifest

KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8")  # what EngineArgs.kv_cache_dtype accepts


def check_kv_cache_dtype(requested: str) -> None:
    """The one rule for a user's kv_cache_dtype (EngineArgs, the CLI's choices)."""
    if requested not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype must be 'auto' (the model's default), 'float32', 'float16' or "
                                  f"'int8', got {requested!r}")


def auto_kv_cache_dtype(manifest: Manifest) -> str:
    """The pool's element type "auto" stands for with MANIFEST (the table above)."""
    if manifest.weights == GGUF_NATIVE and manifest.dtype == "float32":
        return "float16"
    return manifest.dtype


def resolve_kv_cache_dtype(requested: str, manifest: Manifest) -> str:
    """The pool's element type for REQUESTED: "auto" = auto_kv_cache_dtype(manifest); a concrete dtype name
    (what a backend is handed once the engine resolved "auto") stands for itself."""
    if requested == "auto":
        return auto_kv_cache_dtype(manifest)
    if requested not in KV_ITEMSIZE:
        check_kv_cache_dtype(requested)
    return requested
