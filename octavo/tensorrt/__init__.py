"""The GPU room: octavo on an NVIDIA GPU through TensorRT, from kernel to backend.

Named for TensorRT, the runtime that executes the engine. "Triton" inside this package always means OpenAI Triton,
the kernel language (`triton` on PyPI); NVIDIA Triton Inference Server is `octavo.triton_server`.

Build time (`octavo build MODEL --target tensorrt`, `octavo.commands.build`):
- `gpu_kernel`: `octavo.PagedAttention` as one OpenAI-Triton kernel (+ a torch launcher for tests/gpu_check);
  `kernel_launch`: its launch geometry in plain Python;
- `plugin`: the `octavo::PagedAttention` TensorRT plugin (`tensorrt.plugin`), whose AOT implementation hands
  TensorRT the kernel's PTX; `ptx_abi`: that PTX's parameter list made exactly TensorRT's 15 launch arguments;
- `onnx_rewrite` (+ `half_weights`): the export's ONNX rewritten for TensorRT's parser;
- `builder`: parser + builder + optimization profile -> `model.<dtype>.engine` and `tensorrt.json`.

Run time (`EngineArgs(backend="tensorrt")`; `octavo.runtime.model_setup` creates the backend lazily):
- `backend`: `TensorRTBackend`, the `octavo.runtime.backends.base.Backend` that runs a built engine with its KV
  pools in device memory;
- `engine_info`: what an engine folder holds (`tensorrt.json`, aliased pool output names), written by the builder;
- `cuda_api`, `trt_import`: the import-guarded CUDA runtime calls and TensorRT import both sides use.
The run-time modules import no build-time module. Importing any module here, except `gpu_kernel`, needs neither
TensorRT, cuda-python nor triton. What has and has not been run on a GPU: docs/tensorrt.md.
"""
