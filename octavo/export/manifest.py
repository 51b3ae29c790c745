"""octavo.json: the versioned manifest written next to model.onnx (magic + format version)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.export.paths import inside

MAGIC = "octavo-model"
FORMAT_VERSION = 1
MANIFEST_NAME = "octavo.json"
WEIGHT_FORMATS = ("fp32", "int8", "int4", "gguf")  # Manifest.weights (octavo.export.quantize)
KV_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}  # bytes per K/V element, by pool dtype
KV_INT8_SCALE_BYTES = 2  # an int8 pool's head row ends in its float16 scale (plugins/onnxruntime/kv_int8.h)


def kv_head_bytes(dtype: str, head_dim: int) -> int:
    """Bytes of one token's K (or V) row of one kv head in a pool of DTYPE: int8 rows carry their scale."""
    if dtype not in KV_ITEMSIZE:
        raise InvalidRequestError(f"unknown KV cache dtype {dtype!r}; expected one of {sorted(KV_ITEMSIZE)}")
    return head_dim * KV_ITEMSIZE[dtype] + (KV_INT8_SCALE_BYTES if dtype == "int8" else 0)


@dataclass(slots=True)
class Manifest:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3" | "gemma2" | "phi3" | "qwen3_moe" | ...
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int  # max_position_embeddings
    rope_theta: float
    dtype: str = "float32"  # dtype of the KV pool / activations in the graph
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    onnx_file: str = "model.onnx"
    weights_file: str = "model.onnx.data"
    tokenizer_file: str = "tokenizer.json"
    chat_template_file: str | None = "chat_template.jinja"
    source: str = ""  # where it was exported from (informational)
    weights: str = "fp32"  # linear layers' weights: "fp32" | "int8" | "int4" | "gguf" (MatMulNBits; export.quantize)
    # method, bits, block_size, accuracy_level, lm_head, and fallback_* when the block kernel leaves layers to
    # MatMulNBits (QuantConfig.describe; free-form keys, so new ones need no format version); None for fp32
    quantization: dict[str, Any] | None = None
    # an embedding export (export.pooling_config.PoolingConfig.to_json): {"type": "last"|"mean"|"cls", "normalize":
    # bool}; the graph then has the hidden_indices input and the hidden_states output. None: a generative export
    pooling: dict[str, Any] | None = None
    # Mixture-of-Experts layout (octavo.export.moe_spec.MoeSpec.describe: num_experts, top_k,
    # expert_intermediate_size, normalize_top_k, sparse_layers, shared_expert_intermediate_size, op,
    # expert_weights); None for a dense model, and absent from a dense model's file (older octavo reads it)
    moe: dict[str, Any] | None = None
    magic: str = MAGIC
    format_version: int = FORMAT_VERSION

    def kv_bytes_per_block(self, block_size: int, dtype: str | None = None) -> int:
        """Bytes one KV block takes over all layers (key + value pools) when the pool holds DTYPE
        (None: the manifest's dtype)."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * kv_head_bytes(dtype or self.dtype, self.head_dim)

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        data = asdict(self)
        if self.weights == "fp32" and self.quantization is None:  # an fp32 manifest stays readable by older octavo
            del data["weights"], data["quantization"]
        if self.pooling is None:  # likewise a model without pooling
            del data["pooling"]
        if self.moe is None:
            del data["moe"]
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, folder: str | Path) -> "Manifest":
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise ModelFormatError(
                f"{folder} is not an octavo model folder: {MANIFEST_NAME} is missing "
                f"(export one with `octavo export SRC OUT`)"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("magic") != MAGIC:
            raise ModelFormatError(f"{path} is not an octavo manifest (magic {MAGIC!r} missing)")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            newer = isinstance(version, int) and version > FORMAT_VERSION
            raise ModelFormatError(
                f"{path} has format version {version!r}; this octavo reads version {FORMAT_VERSION}. "
                + ("Upgrade octavo to load it." if newer else "Re-export the model with this octavo.")
            )
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ModelFormatError(f"{path} has unknown fields {sorted(unknown)}")
        try:
            manifest = cls(**data)
        except TypeError as exc:
            raise ModelFormatError(f"{path} is incomplete: {exc}") from exc
        if manifest.weights not in WEIGHT_FORMATS:
            raise ModelFormatError(f"{path}: weights {manifest.weights!r} is not one of {WEIGHT_FORMATS} "
                                   "(re-export the model with this octavo)")
        manifest.check_files(folder)
        return manifest

    FILE_FIELDS = ("onnx_file", "weights_file", "tokenizer_file", "chat_template_file")

    def check_files(self, folder: str | Path) -> None:
        """Refuse file names that leave FOLDER: absolute, '..', or a symlink pointing out (octavo.export.paths)."""
        where = Path(folder) / MANIFEST_NAME
        for name in self.FILE_FIELDS:
            value = getattr(self, name)
            if value is None and name == "chat_template_file":
                continue
            if not isinstance(value, str) or not value:
                raise ModelFormatError(f"{where}: {name} must be a file name, got {value!r}")
            inside(folder, value, where=where, subject=name, fix="re-export the model")
