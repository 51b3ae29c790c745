"""`export_model(src, out)`: HF safetensors folder or GGUF file -> an octavo model folder.

OUT receives model.onnx, model.onnx.data (all weights, raw bytes), octavo.json (the Manifest),
tokenizer.json and chat_template.jinja (when the checkpoint has one). The folder is assembled under a
temporary name next to OUT and renamed into place at the end, so a crashed export never leaves a
half-written model behind that looks complete.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import onnx
from tqdm import tqdm

from octavo.errors import ModelFormatError
from octavo.export.checkpoint import Checkpoint, ModelSpec, spec_from_config
from octavo.export.graph import build_model
from octavo.export.hf_reader import PICKLE_SUFFIXES, read_hf_folder
from octavo.export.manifest import MANIFEST_NAME, Manifest
from octavo.export.pooling_config import POOLING_TYPES, PoolingConfig, read_pooling_config
from octavo.export.moe_graph import expert_weights
from octavo.export.quantize import RESIDUAL_ROWS, QuantConfig
from octavo.export.source_weights import default_weights
from octavo.export.weights_file import WeightsFile

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
WEIGHTS_NAME = "model.onnx.data"
TOKENIZER_NAME = "tokenizer.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"


def _read_gguf(path: Path) -> Checkpoint:
    """Adapt the GGUF reader's result (owner: gguf) to the neutral Checkpoint."""
    from octavo.export.gguf_reader import read_gguf

    gguf = read_gguf(path)
    tensors = gguf.tensors
    return Checkpoint(
        config=dict(gguf.config),
        tensor_names=frozenset(tensors),
        get_tensor=tensors.__getitem__,
        get_blocks=tensors.blocks,
        tokenizer_json=gguf.tokenizer_json,
        chat_template=gguf.chat_template,
        source=str(path),
        extra_eos_token_ids=list(getattr(gguf, "eos_token_ids", None) or []),
    )


def read_checkpoint(src: str | Path) -> Checkpoint:
    """Open SRC (an HF folder or a .gguf file) as a Checkpoint; pickle files are refused unopened."""
    src = Path(src)
    if not src.exists():
        raise ModelFormatError(f"{src} does not exist (expected an HF model folder or a .gguf file)")
    if src.is_dir():
        if (src / MANIFEST_NAME).is_file() and not (src / "config.json").is_file():
            raise ModelFormatError(f"{src} is already an exported octavo model folder; nothing to export")
        return read_hf_folder(src)
    if src.suffix.lower() == ".gguf":
        return _read_gguf(src)
    if src.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFormatError(
            f"{src} is a pickle checkpoint; octavo refuses it because loading pickle can run arbitrary "
            f"code. Convert it to safetensors in a trusted environment, or use a GGUF file"
        )
    raise ModelFormatError(f"{src}: expected an HF model folder (config.json + *.safetensors) or a .gguf file")


def _manifest(spec: ModelSpec, has_template: bool, source: str, quant: QuantConfig,
              fallback_layers: list[str], pooling: PoolingConfig | None = None, experts: str = "float32") -> Manifest:
    windows = {w for w in spec.sliding_windows if w}
    return Manifest(
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        max_context=spec.max_context,
        rope_theta=spec.rope_theta,
        rope_scaling=spec.rope_scaling,
        sliding_window=max(windows) if windows else None,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=spec.bos_token_id,
        eos_token_ids=list(spec.eos_token_ids),
        pad_token_id=spec.pad_token_id,
        onnx_file=ONNX_NAME,
        weights_file=WEIGHTS_NAME,
        tokenizer_file=TOKENIZER_NAME,
        chat_template_file=CHAT_TEMPLATE_NAME if has_template else None,
        source=source,
        weights=quant.weights,
        quantization=quant.describe(fallback_layers),
        pooling=pooling.to_json() if pooling is not None else None,
        moe=spec.moe.describe(experts) if spec.moe is not None else None,
    )


def _write_folder(checkpoint: Checkpoint, spec: ModelSpec, folder: Path, progress: bool,
                  quant: QuantConfig, pooling: PoolingConfig | None = None) -> Manifest:
    with tqdm(total=spec.num_layers + 2, desc="export", unit="layer", disable=not progress) as bar:
        with WeightsFile(folder / WEIGHTS_NAME) as weights:
            model = build_model(spec, checkpoint, weights, on_layer=lambda layer: bar.update(1), quant=quant,
                                hidden_states=pooling is not None)
        (folder / ONNX_NAME).write_bytes(model.SerializeToString())
    (folder / TOKENIZER_NAME).write_text(checkpoint.tokenizer_json, encoding="utf-8")
    if checkpoint.chat_template:
        (folder / CHAT_TEMPLATE_NAME).write_text(checkpoint.chat_template, encoding="utf-8")
    manifest = _manifest(spec, bool(checkpoint.chat_template), checkpoint.source, quant, _fallback_layers(model, quant),
                         pooling, expert_weights(model))
    manifest.save(folder)
    return manifest


def _fallback_layers(model: onnx.ModelProto, quant: QuantConfig) -> list[str]:
    """With the block kernel, the projections the graph multiplies with MatMulNBits all the same (an int8/int4
    layer whose K is not a multiple of the block size), named as their weights are: read from the graph written,
    so the manifest says what runs."""
    if not quant.block_kernel:
        return []
    return [node.input[1].removesuffix(".qweight").removesuffix(".weight") for node in model.graph.node
            if node.op_type == "MatMulNBits"]


def _check_out(out: Path, overwrite: bool) -> None:
    """OUT may be missing or empty; with OVERWRITE it may also be a previously exported model."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if overwrite and out.is_dir() and (out / MANIFEST_NAME).is_file():
        return
    raise ModelFormatError(
        f"{out} already exists and is not empty; "
        + ("it is not an octavo model folder, so it is not replaced" if overwrite
           else "pass overwrite=True (`octavo export --force`) to replace an exported model")
    )


def _place(tmp: Path, out: Path, overwrite: bool) -> None:
    _check_out(out, overwrite)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    elif out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _pooling(src: Path, pooling: str | None) -> PoolingConfig | None:
    """The export's pooling: POOLING ("none", a type) or, when None, the sentence-transformers config of SRC."""
    if pooling is None:
        return read_pooling_config(src) if src.is_dir() else None
    if pooling == "none":
        return None
    if pooling not in POOLING_TYPES:
        raise ModelFormatError(f"pooling must be none, {', '.join(POOLING_TYPES)}; got {pooling!r}")
    found = read_pooling_config(src) if src.is_dir() else None
    return PoolingConfig(pooling, normalize=found.normalize if found is not None else True)


def export_model(src: str | Path, out: str | Path, *, progress: bool = True, overwrite: bool = False,
                 weights: str | None = None, quant_block_size: int = 32, accuracy_level: int = 4,
                 quantize_lm_head: bool = False, residual_rows: int = RESIDUAL_ROWS,
                 quant_kernel: str = "block", pooling: str | None = None) -> Manifest:
    """Export SRC (HF folder or .gguf file) into the folder OUT; returns the written Manifest.

    weights: None (default: a GGUF with quantized layers runs its own blocks, "gguf"; anything else
    "fp32"), "fp32", "gguf" (a .gguf's own blocks, exactly: octavo.export.gguf_blocks; lm_head too), or
    "int8" / "int4" to store the linear layers blockwise-quantized by us (quant_block_size values of K
    per scale; quantize_lm_head also quantizes the vocabulary projection). accuracy_level 4 = int8
    compute in ONNX Runtime's CPU kernel. quant_kernel: "block" (default) multiplies quantized weights (int8,
    int4, a GGUF's blocks) with octavo.BlockMatMul; "matmulnbits" with MatMulNBits at accuracy_level, where for
    "gguf" residual_rows > 0 corrects its int8 rounding of the activations in steps of at most that many rows
    (0 = off). See docs/quantization.md.
    pooling: None (default: an embedding export when SRC is a sentence-transformers folder, by its modules.json),
    "last" / "mean" / "cls" (an embedding export pooling that way, normalized, whatever SRC says) or "none" (a
    generative export only). An embedding export's graph also returns hidden states (docs/serving.md)."""
    started = time.perf_counter()
    weights = default_weights(Path(src), weights) or "fp32"
    lm_head = True if weights == "gguf" else quantize_lm_head
    quant = QuantConfig(weights, quant_block_size, accuracy_level, lm_head, residual_rows, quant_kernel).validate()
    out = Path(out)
    checkpoint = read_checkpoint(src)
    spec = spec_from_config(checkpoint.config, checkpoint.extra_eos_token_ids)
    pool = _pooling(Path(src), pooling)
    _check_out(out, overwrite)  # fail before any work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp.chmod(0o755)
    try:
        manifest = _write_folder(checkpoint, spec, tmp, progress, quant, pool)
        _place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s -> %s in %.1f s", src, out, time.perf_counter() - started)
    return manifest
