#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU) for scripts/compare_peers.py, from the llama.cpp sources that the
# llama-cpp-python sdist on PyPI carries (vendor/llama.cpp): PyPI is reachable where GitHub may not be.
# Nothing is committed; the build lives in $OUT (default ~/.cache/octavo/llama.cpp). ~12 min on 2 cores.
#
#   scripts/build_llama_server.sh [VERSION]     # prints the binary's path last
#   .venv/bin/python scripts/compare_peers.py --llama-server "$(scripts/build_llama_server.sh | tail -1)"
set -euo pipefail
VERSION="${1:-0.3.36}"
OUT="${OUT:-$HOME/.cache/octavo/llama.cpp}"
PIP="${PIP:-$(dirname "$0")/../.venv/bin/pip}"
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$SRC/build/bin/llama-server"
if [ ! -x "$BIN" ]; then
    mkdir -p "$OUT"
    if [ ! -d "$SRC" ]; then
        "$PIP" download --no-deps --no-binary :all: --dest "$OUT" "llama-cpp-python==$VERSION" >&2
        tar -xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
    fi
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
    cmake --build "$SRC/build" --target llama-server -j "$(nproc)" >&2
fi
"$BIN" --version >&2
echo "$BIN"
