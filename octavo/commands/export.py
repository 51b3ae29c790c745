"""`octavo export SRC OUT`: HF safetensors folder or GGUF file -> octavo model folder (ONNX + manifest)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

HELP = "export an HF model folder (safetensors) or a .gguf file to ONNX with one PagedAttention node per layer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="HF model folder (config.json + *.safetensors + tokenizer.json), a .gguf file, or "
                                    "'smollm2-135m-instruct' (the embedded SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("out", help="output folder (created; must be empty or missing unless --force)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it is an earlier octavo export")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    q = parser.add_argument_group("quantized weights (docs/quantization.md)")
    q.add_argument("--weights", choices=("fp32", "int8", "int4", "gguf"), default=None,
                   help="linear layers' weights: gguf (a quantized .gguf's own blocks, its default), fp32 (the "
                        "default otherwise), or blockwise int8/int4 quantized by octavo (ONNX Runtime MatMulNBits)")
    q.add_argument("--quant-block-size", type=int, default=32, help="values per scale/zero point (power of two >= 16; default: %(default)s)")
    q.add_argument("--accuracy-level", type=int, default=4, choices=range(5), metavar="{0..4}",
                   help="MatMulNBits accuracy_level: 4 (default) computes in int8 on CPU, 0 in float32")
    q.add_argument("--quantize-lm-head", action="store_true", help="quantize the vocabulary projection too")
    q.add_argument("--quant-kernel", choices=("block", "matmulnbits"), default="block",
                   help="quantized weights (gguf, int8, int4): block (default) runs octavo.BlockMatMul (16-bit "
                        "activations for decode steps, float32 for larger ones); matmulnbits runs ONNX Runtime's "
                        "MatMulNBits at --accuracy-level (int8 activations at 4)")
    q.add_argument("--residual-rows", type=int, default=None,
                   help="--weights gguf --quant-kernel matmulnbits at accuracy level 4: undo the int8 rounding of the activations in steps of "
                        "at most this many tokens (0 = off; default: 64)")


def run(args: argparse.Namespace) -> int:
    from octavo.demo.model import model_argument
    from octavo.export.exporter import export_model

    started = time.perf_counter()
    manifest = export_model(model_argument(args.src)[0], args.out, progress=not args.no_progress, overwrite=args.force,
                            weights=args.weights, quant_block_size=args.quant_block_size,
                            accuracy_level=args.accuracy_level, quantize_lm_head=args.quantize_lm_head,
                            quant_kernel=args.quant_kernel,
                            **({} if args.residual_rows is None else {"residual_rows": args.residual_rows}))
    out = Path(args.out)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(
        f"exported {manifest.architecture} ({manifest.num_layers} layers, hidden {manifest.hidden_size}, "
        f"{manifest.num_heads}/{manifest.num_kv_heads} heads, vocab {manifest.vocab_size}, weights {manifest.weights}) "
        f"to {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f} s"
    )
    return 0
