"""Backends run one packed step of the exported model: onnxruntime (CPU), tensorrt (GPU)."""
from octavo.runtime.backends.base import Backend, StepInputs

__all__ = ["Backend", "StepInputs"]
