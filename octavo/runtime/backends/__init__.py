"""Backends run one packed step of the exported model: onnxruntime (CPU, here) and tensorrt (GPU, octavo.tensorrt).
The contract is base.Backend / base.StepInputs. This package's __init__ imports nothing, so that op_variants (standard
library only) can be imported by setup.py in pip's build environment, where numpy is absent."""
