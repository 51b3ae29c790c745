"""Where the ONNX Runtime custom-op library (octavo.PagedAttention) lives once built."""
from __future__ import annotations

from pathlib import Path

import octavo
from octavo.errors import OpLibraryError

LIBRARY_NAME = "liboctavo_ort.so"


def library_dir() -> Path:
    return Path(octavo.__file__).resolve().parent / "_lib"


def library_path() -> Path:
    """Path of the built custom-op library (register it with SessionOptions.register_custom_ops_library)."""
    path = library_dir() / LIBRARY_NAME
    if not path.is_file():
        raise OpLibraryError(
            f"the ONNX Runtime custom-op library {path} is not built: run `make op` "
            "(or `python -m octavo.runtime.backends.build_op`)"
        )
    return path
