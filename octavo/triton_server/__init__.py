"""NVIDIA Triton Inference Server: octavo served behind a real tritonserver (`octavo triton`).

Not to be confused with OpenAI Triton, the GPU kernel language (octavo.tensorrt.gpu_kernel).

- `model_repository`: writes a Triton model repository for an octavo model from the template in model_repo/ (the
  python-backend model, model_repo/octavo/1/model.py, runs an octavo AsyncEngine inside tritonserver);
- `launcher`: finds, prepares and runs a tritonserver (nvidia-pytriton's, $TRITONSERVER_DIR's or one on PATH);
- `front`: the HTTP front that checks each request before tritonserver parses it;
- `serve`: tritonserver + front together, until Ctrl-C / SIGTERM.
The command line is octavo.commands.triton; the OpenAI-compatible server is octavo.serving. Docs: docs/triton.md.
"""
