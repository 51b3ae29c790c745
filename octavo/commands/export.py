"""`octavo export SRC OUT`: HF safetensors folder or GGUF file -> octavo model folder (ONNX + manifest)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from octavo.export.quant_options import QUANT_KERNEL_HELP, QUANT_KERNELS, RESIDUAL_ROWS  # no numpy: see there

HELP = "export an HF model folder (safetensors) or a .gguf file to ONNX with one PagedAttention node per layer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="HF model folder (config.json + *.safetensors + tokenizer.json), a .gguf file, or "
                                    "'smollm2-135m-instruct' (the embedded SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("out", help="output folder (created; must be empty or missing unless --force)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it is an earlier octavo export")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--pooling", choices=("none", "last", "mean", "cls"), default=None,
                        help="export an embedding model (docs/serving.md, Embeddings): its graph also returns hidden "
                             "states, pooled this way by default (default: what a sentence-transformers folder's "
                             "modules.json says, else none)")
    q = parser.add_argument_group("quantized weights (docs/quantization.md)")
    q.add_argument("--weights", choices=("fp32", "int8", "int4", "gguf"), default=None,
                   help="linear layers' weights: gguf (a quantized .gguf's own blocks, exactly as the file holds them; "
                        "the default for one), fp32 (dequantized to float32; the default otherwise), or int8/int4 "
                        "(blockwise quantized by octavo)")
    q.add_argument("--quant-block-size", type=int, default=None,
                   help="--weights int8|int4: values per scale/zero point (power of two >= 16; default: 32); "
                        "a GGUF's own blocks keep the file's")
    q.add_argument("--accuracy-level", type=int, default=None, choices=range(5), metavar="{0..4}",
                   help="--quant-kernel matmulnbits: MatMulNBits' accuracy_level, 4 (default) computes in int8 on "
                        "CPU, 0 in float32 (with the block kernel it applies only to int8/int4 layers whose K is "
                        "not a multiple of --quant-block-size, which stay MatMulNBits)")
    q.add_argument("--quantize-lm-head", action="store_true",
                   help="--weights int8|int4: quantize the vocabulary projection too (gguf always runs the file's "
                        "own lm_head blocks)")
    q.add_argument("--quant-kernel", choices=QUANT_KERNELS, default=None,
                   help=QUANT_KERNEL_HELP + "; --accuracy-level and --residual-rows change those")
    q.add_argument("--residual-rows", type=int, default=None,
                   help="--weights gguf --quant-kernel matmulnbits at --accuracy-level 4: undo the int8 rounding of "
                        f"the activations in steps of at most this many tokens (0 = off; default: {RESIDUAL_ROWS})")


def _check_quant_flags(args: argparse.Namespace, weights: str) -> None:
    """A quantization flag that would change nothing for WEIGHTS is refused rather than silently ignored
    (the rule the engine's --weights / --quant-kernel share: octavo.export.quant_options)."""
    from octavo.export.quant_options import check_quant_options

    given = [name for name in ("quant_block_size", "accuracy_level", "quant_kernel", "residual_rows")
             if getattr(args, name) is not None] + (["quantize_lm_head"] if args.quantize_lm_head else [])
    check_quant_options(weights, given, args.quant_kernel)


def run(args: argparse.Namespace) -> int:
    from octavo.export.embedded import model_argument
    from octavo.export.exporter import export_model
    from octavo.export.source_weights import default_weights

    started = time.perf_counter()
    src = model_argument(args.src)[0]
    _check_quant_flags(args, default_weights(Path(src), args.weights) or "fp32")
    given = {"quant_block_size": args.quant_block_size, "accuracy_level": args.accuracy_level,
             "quant_kernel": args.quant_kernel, "residual_rows": args.residual_rows}
    manifest = export_model(src, args.out, progress=not args.no_progress, overwrite=args.force, weights=args.weights,
                            quantize_lm_head=args.quantize_lm_head, pooling=args.pooling,
                            **{name: value for name, value in given.items() if value is not None})
    out = Path(args.out)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(
        f"exported {manifest.architecture} ({manifest.num_layers} layers, hidden {manifest.hidden_size}, "
        f"{manifest.num_heads}/{manifest.num_kv_heads} heads, vocab {manifest.vocab_size}, weights {manifest.weights}"
        f"{', pooling ' + manifest.pooling['type'] if manifest.pooling else ''}) "
        f"to {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f} s"
    )
    return 0
