"""`octavo build MODEL --target tensorrt`: compile an exported model into a TensorRT engine (GPU)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

HELP = "build a GPU engine (TensorRT) for an exported model; written next to its manifest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="octavo export folder (an HF folder or .gguf file is exported first)")
    parser.add_argument("--target", choices=("tensorrt",), default="tensorrt", help="engine kind (default tensorrt)")
    parser.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16",
                        help="engine precision and KV pool dtype (default fp16)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block, compiled in (default 16)")
    parser.add_argument("--max-num-tokens", type=int, default=2048, help="most packed tokens per step (default 2048)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step (default 64)")
    parser.add_argument("--max-blocks-per-seq", type=int, default=None,
                        help="block-table width (default: the model's context / block size)")
    parser.add_argument("--max-num-blocks", type=int, default=None,
                        help="largest KV pool the engine accepts, in blocks (default: what fits in "
                             "--gpu-memory-utilization of this GPU's free memory, the pool `serve` allocates)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="share of the free GPU memory the default --max-num-blocks is sized for (default 0.85)")


def _resolve(model: str) -> Path:
    """MODEL's export folder; an HF folder or .gguf file is exported with float32 weights (all TensorRT runs)."""
    from octavo.export.manifest import MANIFEST_NAME

    if (Path(model) / MANIFEST_NAME).is_file():
        return Path(model)
    try:
        from octavo.export.resolve import resolve_model
    except ImportError:  # resolver not available in this build: MODEL must already be an export folder
        return Path(model)
    return resolve_model(model, weights="fp32")


def run(args: argparse.Namespace) -> int:
    from octavo.tensorrt.builder import TensorRTBuildOptions, build_engine, check_float_weights
    from octavo.tensorrt.trt_import import import_tensorrt
    from octavo.export.manifest import MANIFEST_NAME, Manifest

    options = TensorRTBuildOptions(
        dtype={"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[args.dtype],
        block_size=args.block_size, max_num_tokens=args.max_num_tokens, max_num_seqs=args.max_num_seqs,
        max_blocks_per_seq=args.max_blocks_per_seq, max_num_blocks=args.max_num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    try:
        options.validate()
    except ValueError as exc:
        from octavo.errors import InvalidRequestError

        raise InvalidRequestError(str(exc)) from exc
    folder = Path(args.model)
    if (folder / MANIFEST_NAME).is_file():  # a quantized export: its reason first, with or without TensorRT
        check_float_weights(folder, Manifest.load(folder))
    trt = import_tensorrt()  # fail fast, before any export work
    started = time.perf_counter()
    engine = build_engine(_resolve(args.model), options)
    print(f"built {engine} (TensorRT {trt.__version__}, {args.dtype}) in {time.perf_counter() - started:.1f} s")
    return 0
