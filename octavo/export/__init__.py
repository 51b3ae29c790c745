"""Checkpoint (HF safetensors folder or GGUF file) -> ONNX with octavo.PagedAttention + manifest."""
from octavo.export.manifest import FORMAT_VERSION, MAGIC, Manifest

__all__ = ["FORMAT_VERSION", "MAGIC", "Manifest", "export_model"]


def export_model(src, out, **kwargs):  # noqa: ANN001, ANN201 - thin lazy wrapper
    """Export SRC (HF folder or .gguf) into the folder OUT. See octavo.export.exporter."""
    from octavo.export.exporter import export_model as _export

    return _export(src, out, **kwargs)
