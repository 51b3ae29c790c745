"""`import_tensorrt`: NVIDIA's `tensorrt` module with the Python plugin API octavo needs, or a
BackendUnavailableError saying what to install (never a bare ImportError traceback). The builder and the backend
both call it; importing this module imports no TensorRT.
"""
from __future__ import annotations

from types import ModuleType

from octavo.errors import BackendUnavailableError


def import_tensorrt() -> ModuleType:
    """`tensorrt`, or BackendUnavailableError with what to do (never a bare ImportError traceback)."""
    try:
        import tensorrt
    except ImportError as exc:
        raise BackendUnavailableError(
            "TensorRT is not installed (pip install tensorrt on a machine with an NVIDIA GPU); "
            f"`--target tensorrt` and the tensorrt backend need it. Import error: {exc}"
        ) from exc
    except OSError as exc:  # the wheel is there but its CUDA libraries are not loadable
        raise BackendUnavailableError(f"TensorRT is installed but cannot load its libraries: {exc}") from exc
    try:
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise BackendUnavailableError(
            f"TensorRT {tensorrt.__version__} has no tensorrt.plugin (octavo's plugin needs TensorRT >= 10.9, "
            f"which added ahead-of-time Python plugins): {exc}"
        ) from exc
    if not hasattr(trtp, "aot_impl"):
        raise BackendUnavailableError(
            f"TensorRT {tensorrt.__version__} lacks tensorrt.plugin.aot_impl; octavo's plugin needs TensorRT >= 10.9 "
            "(pip install -U tensorrt)"
        )
    return tensorrt
