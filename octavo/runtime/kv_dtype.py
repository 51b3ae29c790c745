"""KV cache element types: what `EngineArgs.kv_cache_dtype` accepts and which dtype a pool then holds.
Bytes per block: Manifest.kv_bytes_per_block; the onnxruntime pools: backends/ort_kv_pools.py.

`EngineArgs.kv_cache_dtype` is "auto" (the pool holds what the manifest says: float32 for every
onnxruntime export) or "float16" (half the bytes per block; the activations stay float32 and the op
converts K/V on write and on read).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from octavo.errors import InvalidRequestError
from octavo.export.manifest import KV_ITEMSIZE

if TYPE_CHECKING:
    from octavo.export.manifest import Manifest

KV_CACHE_DTYPES = ("auto", "float16")  # what EngineArgs.kv_cache_dtype accepts


def check_kv_cache_dtype(requested: str) -> None:
    """The one rule for a user's kv_cache_dtype (EngineArgs, the CLI's choices)."""
    if requested not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype must be 'auto' (the model's dtype) or 'float16', "
                                  f"got {requested!r}")


def resolve_kv_cache_dtype(requested: str, manifest: Manifest) -> str:
    """The pool's element type for REQUESTED: "auto" = the manifest's dtype; a concrete dtype name
    (what a backend is handed once the engine resolved "auto") stands for itself."""
    if requested == "auto":
        return manifest.dtype
    if requested not in KV_ITEMSIZE:
        check_kv_cache_dtype(requested)
    return requested
