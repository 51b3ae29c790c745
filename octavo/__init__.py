"""octavo: LLM serving with a paged KV cache and continuous batching."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from octavo.version import __version__

_LAZY = {
    "LLM": "octavo.runtime.llm",
    "AsyncEngine": "octavo.runtime.async_engine",
    "LLMEngine": "octavo.runtime.engine",
    "SamplingParams": "octavo.runtime.sampling_params",
    "StructuredOutputsParams": "octavo.structured.params",
    "BeamSearchParams": "octavo.runtime.beam_search",
    "PoolingParams": "octavo.runtime.pooling_params",
    "EngineArgs": "octavo.runtime.engine_args",
    "RequestOutput": "octavo.runtime.outputs",
    "CompletionOutput": "octavo.runtime.outputs",
    "export_model": "octavo.export",
}

__all__ = list(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from octavo.export import export_model
    from octavo.runtime.async_engine import AsyncEngine
    from octavo.runtime.beam_search import BeamSearchParams
    from octavo.runtime.engine import LLMEngine
    from octavo.runtime.engine_args import EngineArgs
    from octavo.runtime.llm import LLM
    from octavo.runtime.outputs import CompletionOutput, RequestOutput
    from octavo.runtime.pooling_params import PoolingParams
    from octavo.runtime.sampling_params import SamplingParams
    from octavo.structured.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    """Import the public API lazily so `import octavo` stays cheap (no onnxruntime at import)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
