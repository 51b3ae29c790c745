"""Optional dependencies: which `pip install 'octavo[EXTRA]'` provides a module that is missing.

The core install runs export, generate, chat and bench; the server, the plots, the Triton kernels, the GPU
backend and the peer comparisons each need an extra (pyproject.toml's [project.optional-dependencies]).
"""
from __future__ import annotations

# top-level module -> the extra that installs it
MODULE_EXTRAS = {
    "aiohttp": "serve",
    "prometheus_client": "serve",
    "zmq": "serve",
    "msgspec": "serve",
    "ray": "ray",
    "starlette": "ray",
    "matplotlib": "plot",
    "triton": "kernels",
    "tensorrt": "gpu",
    "cuda": "gpu",
    "onnxruntime_genai": "perf",
    "onnx_ir": "perf",
    "torch": "test",
    "transformers": "test",
}


def missing_extra_message(error: ModuleNotFoundError) -> str | None:
    """One line naming the pip command that installs the missing module, or None if it is no extra's."""
    module = (error.name or "").split(".")[0]
    extra = MODULE_EXTRAS.get(module)
    if extra is None:
        return None
    return f"this needs the optional dependency {module!r}: pip install 'octavo[{extra}]'"
