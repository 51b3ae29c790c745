#!/usr/bin/env bash
# Serve a model with octavo behind a real NVIDIA Triton Inference Server.
#
#   scripts/triton_serve.sh MODEL [REPO_OUT] [extra `octavo triton` options...]
#
# MODEL: an octavo export folder, an HF checkpoint folder or a .gguf file (exported once into the cache).
# REPO_OUT: where the model repository is written (default: ./triton_repo).
# Uses the tritonserver bundled by nvidia-pytriton in the venv (or $TRITONSERVER_DIR); ports default to
# 8000 (HTTP), 8001 (gRPC), 8002 (metrics) and can be changed with --http-port/--grpc-port/--metrics-port.
# Try it:  curl -s localhost:8000/v2/models/octavo/generate -d '{"text_input": "Hello", "max_tokens": 16}'
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
if [ $# -lt 1 ]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
model="$1"; shift
repo="${1:-$here/triton_repo}"
if [ $# -ge 1 ] && [[ "$1" != --* ]]; then shift; fi
exec "$py" -m octavo triton "$model" --repo-out "$repo" --install-numpy "$@"
