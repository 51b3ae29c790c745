"""`resolve_model(path)`: whatever the user named -> an exported octavo model folder.

An export folder (octavo.json present) is returned as is, after its manifest is validated. An HF
folder or a .gguf file is exported once into the cache, `$OCTAVO_CACHE` (default
~/.cache/octavo/models), as `<name>-<fingerprint>`, and that folder is returned; later calls find it.
The fingerprint hashes the octavo format version and the source files' names, sizes and contents
(files over 64 MiB: their first and last 16 MiB), so an edited checkpoint gets a fresh export without
rereading gigabytes on every start. A file lock keeps two processes from exporting the same model at once.
A quantized GGUF runs on its own blocks by default (`weights="gguf"`, cache folder `<name>-gguf-block-...`;
`weights="fp32"` dequantizes it as before). `weights="int8"|"int4"` exports the quantized variant into its own folder,
`<name>-<format>-b<block>-block[-head]-<fingerprint>` (QuantConfig.cache_tag: the format, quant block size, kernel
and lm_head choice are part of the name and of the fingerprint); `quant_kernel="matmulnbits"` tags the folder with
MatMulNBits' accuracy level instead of `block` (`<name>-gguf-a4-r64-...`, `<name>-int4-b32-a4-...`), so two kernels
never share a folder. For an export folder what the caller names must match the folder's manifest
(ExportMismatchError otherwise).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
from pathlib import Path

from octavo.errors import ExportMismatchError, ModelFormatError
from octavo.export.embedded import default_model_path, is_embedded_name
from octavo.export.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from octavo.export.quant_options import (DEFAULT_QUANT_KERNEL, KERNEL_METHODS, check_quant_kernel, check_quant_options,
                                         check_weight_options, methods_of)
from octavo.export.quantize import GGUF_NATIVE, QuantConfig
from octavo.export.source_weights import default_weights

log = logging.getLogger(__name__)

_FULL_HASH_LIMIT = 64 * 2**20
_EDGE = 16 * 2**20
# bump when the graph the exporter writes changes in a way old cached exports should not be reused
GRAPH_REVISION = 4  # 2: BlockMatMul takes the decode_step flag (16-bit decode batches); 3: it writes q/k/v, gate/up
# parts itself; 4: K-quants keep two-level scales (int8 factors of float32 super-block scales, BlockMatMul and MoE)
# and a GGUF's embedding stays in its blocks (octavo.BlockGather; a tied lm_head shares them), and a fused
# projection of two block layouts runs one BlockMatMul per layout (no promotion)


def cache_root() -> Path:
    return Path(os.environ.get("OCTAVO_CACHE") or Path.home() / ".cache" / "octavo" / "models").expanduser()


def _hash_file(digest: "hashlib._Hash", path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(2**20), b""):
                digest.update(chunk)
        else:
            digest.update(f.read(_EDGE))
            f.seek(size - _EDGE)
            digest.update(f.read(_EDGE))


def fingerprint(source: Path, quant: QuantConfig | None = None) -> str:
    """A short content hash of an HF folder or a GGUF file (see the module docstring) and the weight format."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"octavo-format-{FORMAT_VERSION}-graph-{GRAPH_REVISION}\0".encode())
    if quant is not None and quant.enabled:
        digest.update(f"weights-{quant.cache_tag()}\0".encode())
    files = sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith(".")) if source.is_dir() else [source]
    for path in files:
        _hash_file(digest, path)
    return digest.hexdigest()


def _cache_name(source: Path) -> str:
    stem = source.name if source.is_dir() else source.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"


def _is_export_folder(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def _quant_config(weights: str | None, quant_block_size: int | None, quantize_lm_head: bool,
                  quant_kernel: str | None) -> QuantConfig:
    check_weight_options(weights, quant_block_size, quantize_lm_head)
    block_size = QuantConfig().block_size if quant_block_size is None else quant_block_size
    kernel = quant_kernel or DEFAULT_QUANT_KERNEL
    if weights == GGUF_NATIVE:  # block sizes and lm_head are the file's
        return QuantConfig(GGUF_NATIVE, block_size, lm_head=True, kernel=kernel).validate()
    return QuantConfig(weights or "fp32", block_size, lm_head=quantize_lm_head, kernel=kernel).validate()


def _check_kernel_applies(source: Path, weights: str, quant_kernel: str | None) -> None:
    """quant_kernel with weights it does not apply to (fp32) is refused, by the rule `octavo export` applies."""
    check_quant_options(weights, ["quant_kernel"] if quant_kernel is not None else [], quant_kernel,
                        subject=str(source), spell=lambda option: option)


def _check_export_matches(source: Path, manifest: Manifest, weights: str | None, quant_block_size: int | None,
                          quantize_lm_head: bool, quant_kernel: str | None) -> None:
    """An export folder's weight format is fixed: what the caller named must be what it holds."""
    howto = ("the weight format is chosen at export time: pass the HF folder or .gguf file instead, or "
             f"`octavo export SRC OUT --weights {weights or manifest.weights}`")
    if weights is not None and manifest.weights != weights:
        raise ExportMismatchError(f"{source} is an export with {manifest.weights} weights, not {weights}; {howto}")
    _check_kernel_applies(source, manifest.weights, quant_kernel)
    quantization = manifest.quantization or {}
    if quant_block_size is not None and quantization.get("block_size") != quant_block_size:
        raise ExportMismatchError(f"{source} was exported with quant block size {quantization.get('block_size')}, "
                                  f"not {quant_block_size}; {howto} --quant-block-size {quant_block_size}")
    if quantize_lm_head and not quantization.get("lm_head"):
        raise ExportMismatchError(f"{source} was exported without a quantized lm_head; {howto} --quantize-lm-head")
    method = methods_of(quantization)[0]  # the kernel it was exported for (older exports: MatMulNBits)
    bf16 = quantization.get("prompt_arithmetic") == "bfloat16"  # exported with block-bf16
    if quant_kernel is not None and method == KERNEL_METHODS[quant_kernel] and bf16 != (quant_kernel == "block-bf16"):
        raise ExportMismatchError(f"{source} was exported with quant_kernel {'block-bf16' if bf16 else 'block'}, "
                                  f"not {quant_kernel!r}; {howto} --quant-kernel {quant_kernel}")
    if quant_kernel is not None and method != KERNEL_METHODS[quant_kernel]:
        raise ExportMismatchError(f"{source} multiplies its {manifest.weights} weights with {method}, not "
                                  f"{KERNEL_METHODS[quant_kernel]} (quant_kernel={quant_kernel!r}); {howto} "
                                  f"--quant-kernel {quant_kernel}")


def resolve_model(path: str | Path, *, progress: bool = True, weights: str | None = None,
                  quant_block_size: int | None = None, quantize_lm_head: bool = False,
                  quant_kernel: str | None = None) -> Path:
    """An octavo export folder for PATH (an export folder, an HF folder or a .gguf file).

    weights: None (a quantized GGUF: its own blocks, "gguf"; anything else: float32), "fp32", "int8" /
    "int4" (our quantization, docs/quantization.md) or "gguf" (a .gguf file's own blocks, exact);
    quant_block_size (None = 32) and quantize_lm_head only with int8/int4; quant_kernel (None = "block",
    octavo.BlockMatMul; "matmulnbits", ONNX Runtime's MatMulNBits) only with quantized weights. For an export
    folder None accepts any format; whatever is named must match its manifest (ExportMismatchError)."""
    check_quant_kernel(quant_kernel)
    source = default_model_path() if is_embedded_name(path) else Path(path).expanduser()
    if source.exists():
        weights = default_weights(source, weights)
    quant = _quant_config(weights, quant_block_size, quantize_lm_head, quant_kernel)
    if _is_export_folder(source) and not (source / "config.json").is_file():
        manifest = Manifest.load(source)  # raises a clear ModelFormatError (e.g. newer format version)
        _check_export_matches(source, manifest, weights, quant_block_size, quantize_lm_head, quant_kernel)
        return source
    if not source.exists():  # say so: "not a model" sends the user looking at the file's contents
        raise ModelFormatError(
            f"{source} does not exist; pass an octavo export folder, an HF model folder or "
            "a .gguf file (`octavo serve` with no model serves the embedded SmolLM2-135M-Instruct)")
    is_hf = source.is_dir() and (source / "config.json").is_file()
    is_gguf = source.is_file() and source.suffix.lower() == ".gguf"
    if not (is_hf or is_gguf):
        raise ModelFormatError(
            f"{source} is not a model: expected an octavo export folder (octavo.json), an HF model "
            f"folder (config.json + *.safetensors) or a .gguf file"
        )
    _check_kernel_applies(source, quant.weights, quant_kernel)
    from octavo.export.exporter import export_model

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tag = quant.cache_tag()
    target = root / f"{_cache_name(source)}-{tag + '-' if tag else ''}{fingerprint(source, quant)}"
    with (root / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_export_folder(target):
            try:
                Manifest.load(target)
                log.info("using cached export %s for %s", target, source)
                return target
            except ModelFormatError as exc:
                log.warning("cached export %s is unusable (%s); exporting again", target, exc)
        log.info("exporting %s into the cache at %s", source, target)
        export_model(source, target, progress=progress, overwrite=True, weights=quant.weights,
                     quant_block_size=quant.block_size, accuracy_level=quant.accuracy_level,
                     quantize_lm_head=quant.lm_head, quant_kernel=quant.kernel)
    return target
