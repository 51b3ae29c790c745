"""What `weights=None` means for a source: a GGUF whose linear layers are quantized runs on its own blocks, anything
else keeps float32. One rule for `export_model`, `resolve_model` and `octavo export`'s flag checks."""
from __future__ import annotations

from pathlib import Path

from octavo.errors import InvalidRequestError
from octavo.export.quantize import GGUF_NATIVE


def default_weights(source: Path, weights: str | None) -> str | None:
    """What WEIGHTS=None means for SOURCE: a GGUF whose linear layers are quantized runs on its own
    blocks ("gguf"); anything else keeps float32. An explicit choice is kept, and "gguf" is refused
    for a source that is not a .gguf file."""
    is_gguf = source.is_file() and source.suffix.lower() == ".gguf"
    if weights == GGUF_NATIVE and not is_gguf:
        raise InvalidRequestError(f"weights='gguf' runs a GGUF file's own quantized blocks; {source} is not a "
                                  ".gguf file (use 'fp32', 'int8' or 'int4')")
    if weights is not None or not is_gguf:
        return weights
    from octavo.export.gguf_reader import quantized_linear_types

    return GGUF_NATIVE if quantized_linear_types(source) else None
