"""Random-weight GGUFs at the sizes users run, made the way a user's file is made: transformers writes an HF
folder (`save_pretrained`, SmolLM2's tokenizer taken from the embedded model), llama.cpp's own
`convert_hf_to_gguf.py` converts it to F16, and its `llama-quantize` quantizes it (Q4_K_M, Q4_0, Q8_0, ...).

Built once and cached under ~/.cache/octavo/perf/gguf/<shape>/ (never committed: they are weights);
a second call prints the cached paths. llama.cpp comes from benchmarks/build_llama_server.sh (it builds
llama-server and llama-quantize; the converter is in the same source tree and runs with that tree's gguf-py).

    benchmarks/build_llama_server.sh                              # once: ~12 min on 2 cores
    .venv/bin/python -m benchmarks.make_gguf llama-1b --types Q4_K_M,Q4_0,Q8_0
    .venv/bin/python -m benchmarks.make_gguf qwen3moe-1b --types Q4_K_M
    .venv/bin/python -m benchmarks.compare_peers --model "$(.venv/bin/python -m benchmarks.make_gguf llama-1b | tail -1)" \\
        --llama-server ~/.cache/octavo/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server

Shapes (vocabulary: SmolLM2's 49,152 tokens; untied embeddings; weights from transformers' own init, seed 0):

    llama-1b      LlamaForCausalLM, hidden 2048, 22 layers, 32/4 heads, MLP 5632 (~1.2B; TinyLlama's shape)
    llama-3b      LlamaForCausalLM, hidden 3072, 28 layers, 24/8 heads, MLP 8192 (~3.2B; Llama-3.2-3B's shape)
    qwen3moe-1b   Qwen3MoeForCausalLM, hidden 1024, 16 layers, 16/4 heads (head dim 64), 32 experts top-4,
                  expert MLP 512 (~0.95B total, ~0.25B active; issue 40's shape)

The decoder's outputs are meaningless (random weights); what the file measures is speed: its tensor shapes
and quant types are those of a real model of that size.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_SRC", Path.home() / ".cache/octavo/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))
WORKDIR = Path(os.environ.get("OCTAVO_PERF_DIR", Path.home() / ".cache/octavo/perf")) / "gguf"
RECIPE_VERSION = 1  # part of every cache folder's name: bump when what a shape builds changes


@dataclass(slots=True, frozen=True)
class Shape:
    """One random-weight model: its transformers architecture and config fields."""

    name: str
    architecture: str
    config: dict[str, Any]


SHAPES = {
    "llama-1b": Shape("llama-1b", "LlamaForCausalLM", {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4, "intermediate_size": 5632, "rope_theta": 10000.0}),
    "llama-3b": Shape("llama-3b", "LlamaForCausalLM", {
        "model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "intermediate_size": 8192, "rope_theta": 500000.0}),
    "qwen3moe-1b": Shape("qwen3moe-1b", "Qwen3MoeForCausalLM", {
        "model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 3072, "moe_intermediate_size": 512,
        "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rope_theta": 1000000.0}),
}


class RecipeError(RuntimeError):
    """A step of the recipe failed (missing llama.cpp build, converter or quantizer error)."""


def converter(src: Path = LLAMA_CPP) -> Path:
    """convert_hf_to_gguf.py of the llama.cpp tree SRC, or RecipeError naming the fix."""
    convert = src / "convert_hf_to_gguf.py"
    if not convert.is_file():
        raise RecipeError(f"no llama.cpp convert_hf_to_gguf.py under {src}: run benchmarks/build_llama_server.sh "
                          "(or set LLAMA_CPP_SRC to a llama.cpp tree)")
    return convert


def quantizer(src: Path = LLAMA_CPP) -> Path:
    """llama-quantize built in the llama.cpp tree SRC, or RecipeError naming the fix."""
    found = [p for p in (src / "build/bin/llama-quantize", src / "build-noamx/bin/llama-quantize") if p.is_file()]
    if not found:
        raise RecipeError(f"no llama-quantize built under {src}: run benchmarks/build_llama_server.sh")
    return found[0]


def hf_folder(shape: Shape, out: Path, seed: int = 0) -> Path:
    """OUT: config.json, bfloat16 model.safetensors with transformers' random init, SmolLM2's tokenizer."""
    import torch
    import transformers

    from octavo.export.embedded import default_model_path

    gguf = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg_cls = transformers.AutoConfig.for_model(shape.config["model_type"]).__class__
    fields = {k: v for k, v in shape.config.items() if k != "model_type"}
    config = cfg_cls(vocab_size=len(tok), tie_word_embeddings=False, max_position_embeddings=8192,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, rms_norm_eps=1e-5,
                     architectures=[shape.architecture], **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    del model
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    log.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RecipeError(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} failed ({proc.returncode}): "
                          f"{(proc.stderr.strip() or proc.stdout.strip())[-800:]}")


def make(shape_name: str, types: list[str], workdir: Path = WORKDIR, src: Path = LLAMA_CPP) -> dict[str, Path]:
    """{type: path} of SHAPE_NAME's GGUF in each quant type (F16 included), made where missing."""
    if shape_name not in SHAPES:
        raise RecipeError(f"unknown shape {shape_name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[shape_name]
    base = workdir / f"{shape.name}-v{RECIPE_VERSION}"
    base.mkdir(parents=True, exist_ok=True)
    f16 = base / f"{shape.name}-F16.gguf"
    out = {"F16": f16}
    if not f16.is_file():
        hf = base / "hf"
        if not (hf / "config.json").is_file():
            log.info("writing the random-weight HF folder %s", hf)
            hf_folder(shape, hf)
        tmp = f16.with_suffix(".tmp")
        run([sys.executable, str(converter(src)), str(hf), "--outtype", "f16", "--outfile", str(tmp)],
            env={"PYTHONPATH": str(src / "gguf-py")})
        tmp.rename(f16)
        shutil.rmtree(hf)  # the F16 GGUF holds everything the quantized files are made from
    for t in types:
        if t.upper() == "F16":
            continue
        path = base / f"{shape.name}-{t.upper()}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            run([str(quantizer(src)), str(f16), str(tmp), t.upper()])
            tmp.rename(path)
        out[t.upper()] = path
    (base / "recipe.json").write_text(json.dumps({"shape": shape.name, "architecture": shape.architecture,
                                                  "config": shape.config, "llama_cpp": str(src),
                                                  "files": {f.name: f.stat().st_size
                                                            for f in sorted(base.glob("*.gguf"))}}, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--types", default="Q4_K_M", help="comma list of llama-quantize types (default Q4_K_M)")
    p.add_argument("--workdir", type=Path, default=WORKDIR, help=f"cache folder (default {WORKDIR})")
    p.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="built llama.cpp source tree (default: "
                   "benchmarks/build_llama_server.sh's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    try:
        paths = make(args.shape, types, args.workdir, args.llama_cpp)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for t in types:  # the last line is the last type's path (for $(...))
        print(paths[t.upper()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
