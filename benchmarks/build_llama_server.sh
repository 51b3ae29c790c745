#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU) for benchmarks/compare_peers.py, from the llama.cpp sources that the
# llama-cpp-python sdist on PyPI carries (vendor/llama.cpp): PyPI is reachable where GitHub may not be.
# Also builds llama-quantize (benchmarks/make_gguf.py). Nothing is committed; the build lives in $OUT (default ~/.cache/octavo/llama.cpp). ~12 min on 2 cores.
#
#   benchmarks/build_llama_server.sh [--no-amx] [VERSION]     # prints the binary's path last
#   .venv/bin/python -m benchmarks.compare_peers --llama-server "$(benchmarks/build_llama_server.sh | tail -1)"
#
# (--no-binary names only llama-cpp-python: its build tools come as wheels, not built from source.)
# --no-amx: the -march=native build without Intel AMX (its own build folder, build-noamx). On a 2-core VM with
# AMX flags (2026-12-02) llama.cpp 0.3.36's AMX matmul died with SIGILL on its first ldtilecfg, in a worker
# thread, though a one-thread AMX probe ran there; without AMX it uses its AVX-512 (VNNI, BF16) kernels.
set -euo pipefail
AMX=1
if [ "${1:-}" = "--no-amx" ]; then
    AMX=0
    shift
fi
VERSION="${1:-0.3.36}"
OUT="${OUT:-$HOME/.cache/octavo/llama.cpp}"
PIP="${PIP:-$(dirname "$0")/../.venv/bin/pip}"
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$SRC/build"
FLAGS=()
if [ "$AMX" = 0 ]; then
    BUILD="$SRC/build-noamx"
    # explicit -mno-* flags win over -march=native in GCC whatever their order
    FLAGS=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
           -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
BIN="$BUILD/bin/llama-server"
if [ ! -x "$BIN" ]; then
    mkdir -p "$OUT"
    if [ ! -d "$SRC" ]; then
        "$PIP" download --no-deps --no-binary llama-cpp-python --dest "$OUT" "llama-cpp-python==$VERSION" >&2
        tar -xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
    fi
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON "${FLAGS[@]}" >&2
    cmake --build "$BUILD" --target llama-server -j "$(nproc)" >&2
fi
if [ ! -x "$BUILD/bin/llama-quantize" ]; then  # benchmarks/make_gguf.py quantizes with it
    cmake --build "$BUILD" --target llama-quantize -j "$(nproc)" >&2
fi
"$BIN" --version >&2
echo "$BIN"
