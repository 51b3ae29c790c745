"""Read a GGUF file (llama.cpp's format) into a neutral checkpoint: HF-style config, lazy HF-layout
tensors, a rebuilt HF `tokenizers` tokenizer.json, and the chat template.

    ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config["num_hidden_layers"], ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].shape

Metadata keys used (llama.cpp's names): general.architecture, general.name, <arch>.block_count,
.embedding_length, .feed_forward_length, .context_length, .attention.head_count, .attention.head_count_kv,
.attention.key_length, .attention.layer_norm_rms_epsilon, .attention.sliding_window, .rope.freq_base,
.rope.scaling.type/.factor/.original_context_length, .vocab_size, and tokenizer.* (see gguf_tokenizer).
Architectures: llama (and Mistral, told apart by a sliding window), qwen2 (q/k/v biases), qwen3 (per-head
q/k RMSNorm tensors blk.N.attn_q_norm / attn_k_norm, explicit key_length = head_dim), phi3 (fused
blk.N.attn_qkv and gate/up in blk.N.ffn_up, named qkv_proj / gate_up_proj; its sliding window applies to
every layer, as in transformers; the 128k files' rope_factors_long/short tensors are longrope (gguf_rope);
rope.dimension_count < key_length is Phi-4-mini's partial rotary), smollm3 (llama with q/k permuted; no rope
on every 4th layer, which llama.cpp fixes and does not store), gemma2 / gemma3 (octavo.export.gguf_gemma).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from octavo.errors import ModelFormatError, UnsupportedArchitectureError
from octavo.export.gguf_gemma import GEMMA_GGUF_ARCHITECTURES, gemma_config
from octavo.export.gguf_header import check_header
from octavo.export.gguf_moe import moe_architecture, moe_config, moe_expected_shapes, moe_prefix
from octavo.export.gguf_rope import rope_scaling_from_gguf
from octavo.export.gguf_tensors import GGUFTensors, index_tensors
from octavo.export.gguf_tokenizer import build_tokenizer_json

log = logging.getLogger(__name__)

# GGUF general.architecture -> (HF model_type, HF architectures entry, q/k rows permuted by llama.cpp)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("mistral", "MistralForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "phi3": ("phi3", "Phi3ForCausalLM", False),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM", True),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
    # Mixture-of-Experts (octavo.export.gguf_moe; a llama file with experts is Mixtral)
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
}
FUSED_ARCHITECTURES = ("phi3",)  # blk.N.attn_qkv (q, k, v fused) and blk.N.ffn_up = gate and up fused
# blk.N.attn_q_norm / attn_k_norm ([head_dim]) in every layer (by HF model_type)
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3_text", "qwen3_moe")
SMOLLM3_NO_ROPE_LAYER_STEP = 4  # llama.cpp's n_no_rope_layer_step for smollm3 (not in the file)
# the layer norms each layer has, by HF model_type (Gemma: sandwich norms)
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
LAYER_NORMS = {"gemma2": _GEMMA_NORMS, "gemma3_text": _GEMMA_NORMS}
GGUF_MAGIC = b"GGUF"


@dataclass(slots=True)
class GGUFCheckpoint:
    """Everything the exporter needs from a GGUF file, in HF terms."""

    config: dict[str, Any]  # HF-style config.json content
    tensors: Mapping[str, np.ndarray]  # HF name -> float32, HF layout; dequantized lazily per lookup
    tokenizer_json: str  # HF `tokenizers` tokenizer.json text
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    source: str  # general.name (or the file name)
    metadata: dict[str, Any]  # every scalar GGUF metadata field (arrays left out), for reports


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open PATH and describe it as a HF-style checkpoint; ModelFormatError if it is not a usable GGUF."""
    path = Path(path)
    reader = _open(path)
    meta = _metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; octavo reads "
            f"{', '.join(ARCHITECTURES)} (Llama-family) GGUF files"
        )
    config = _config(meta, reader, arch, path)
    moe = moe_architecture(meta, arch) is not None
    if moe:
        config.update(moe_config(meta, arch, {str(t.name) for t in reader.tensors}, config["num_hidden_layers"], path))
    tensors: GGUFTensors = index_tensors(
        reader, num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
        permuted_qk=ARCHITECTURES[arch][2], fused_gate_up=arch in FUSED_ARCHITECTURES,
        gemma=arch in GEMMA_GGUF_ARCHITECTURES,
        moe_prefix=moe_prefix(config["model_type"]) if moe else None,
    )
    config["attention_bias"] = any(f"model.layers.0.self_attn.{n}.bias" in tensors for n in ("q_proj", "qkv_proj"))
    if arch == "qwen2" and not config["attention_bias"]:
        raise ModelFormatError(f"{path.name}: a qwen2 GGUF must have q/k/v biases (blk.0.attn_q.bias is missing)")
    _check_tensors(tensors, config, path, moe_expected_shapes(config) if moe else {})
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    tokenizer_json = build_tokenizer_json(meta, path.name)
    eos_ids = _eos_ids(meta)
    return GGUFCheckpoint(
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        source=str(meta.get("general.name") or path.name),
        metadata={k: v for k, v in meta.items() if not isinstance(v, list)},
    )


FLOAT_TYPE_IDS = (0, 1, 30)  # GGML's F32, F16, BF16
# GGML type ids of the quantized types octavo reads (gguf.GGMLQuantizationType; the enum is not imported
# here so that an engine start with a cached export does not load the gguf package)
GGML_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
                   13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS"}


def quantized_linear_types(path: str | Path) -> dict[str, int]:
    """GGML type -> count of the file's quantized 2-D layer weights (blk.N.*; MoE files: the 3-D experts too), e.g.
    {"Q4_1": 210}; empty
    for a float file. Decides what `weights=None` means for it (octavo.export.source_weights.default_weights)."""
    counts: dict[str, int] = {}
    for name, n_dims, type_id in check_header(Path(path)):  # the header only: cheap on every engine start
        if name.startswith("blk.") and n_dims in (2, 3) and type_id not in FLOAT_TYPE_IDS:
            kind = GGML_TYPE_NAMES.get(type_id, f"type {type_id}")
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _open(path: Path) -> Any:
    """A gguf.GGUFReader over PATH, with every failure turned into a ModelFormatError."""
    if not path.is_file():
        raise ModelFormatError(f"GGUF file {path} does not exist")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        hint = " (it looks like a Git LFS pointer: fetch the real file with `git lfs pull`)" if magic == b"vers" else ""
        raise ModelFormatError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}){hint}")
    check_header(path)  # counts and lengths fit in the file: GGUFReader would loop over whatever they say
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001 - the gguf package raises assorted types on bad input
        raise ModelFormatError(
            f"{path} is not a readable GGUF file: it is truncated or corrupt ({path.stat().st_size} bytes; the gguf "
            f"reader failed with {type(exc).__name__}: {exc}). Download or convert it again"
        ) from exc
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ModelFormatError(
                f"{path} is truncated: tensor {tensor.name!r} needs bytes up to {end} but the file has {size}"
            )
    return reader


def _metadata(reader: Any, path: Path) -> dict[str, Any]:
    """GGUF key/value fields as plain Python values (str, int, float, bool, lists of those)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except Exception as exc:  # noqa: BLE001
            raise ModelFormatError(f"{path}: metadata field {key!r} cannot be decoded: {exc}") from exc
        meta[key] = value
    return meta


def _config(meta: dict[str, Any], reader: Any, arch: str, path: Path) -> dict[str, Any]:
    """The HF config.json dict of the model."""
    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelFormatError(f"{path.name}: GGUF metadata {full!r} is missing")
        return meta[full]

    model_type, hf_arch, _ = ARCHITECTURES[arch]
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    # The embedding's row count is the model's vocabulary (it may be padded past the token list).
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ModelFormatError(f"{path.name}: the GGUF file has no token_embd.weight tensor")
    vocab = int(embedding.shape[-1]) if len(embedding.shape) == 2 else 0
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if len(tokens) > vocab:
        raise ModelFormatError(f"{path.name}: the tokenizer has {len(tokens)} tokens but token_embd.weight only {vocab} rows")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "pad_token_id": _opt_int(meta.get("tokenizer.ggml.padding_token_id")),
    }
    eos = _eos_ids(meta)
    config["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        if arch not in FUSED_ARCHITECTURES or not 0 < rope_dims < head_dim:
            raise ModelFormatError(
                f"{path.name}: partial rotary embedding ({arch}.rope.dimension_count={rope_dims}, head_dim "
                f"{head_dim}) is supported for phi3 files only"
            )
        config["partial_rotary_factor"] = rope_dims / head_dim  # int(head_dim * factor) == rope_dims
    scaling = rope_scaling_from_gguf(meta, reader, arch, rope_dims, config["rope_theta"], path.name)
    if scaling is not None:
        config["rope_scaling"] = scaling
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
        if arch == "llama":  # llama.cpp writes Mistral models as "llama"; the window is what tells them apart
            config["model_type"], config["architectures"] = "mistral", ["MistralForCausalLM"]
        if arch == "qwen3":  # one window for every layer, as the metadata states it
            config["use_sliding_window"] = True
            config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    if arch == "smollm3":
        config["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_LAYER_STEP
    if arch in GEMMA_GGUF_ARCHITECTURES:
        config = gemma_config(meta, arch, config, path.name)
    return config


def _check_tensors(tensors: GGUFTensors, config: dict[str, Any], path: Path,
                   moe_shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor a Llama-family model needs is present with the shape the config implies; MOE_SHAPES: the
    experts' tensors of an MoE file (whose sparse layers have no dense MLP)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    ffn = config["intermediate_size"]
    qk_norm = config["model_type"] in QK_NORM_ARCHITECTURES
    expected: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    fused = config["model_type"] in FUSED_ARCHITECTURES
    sparse = set(range(layers)) - set(config.get("mlp_only_layers") or []) if moe_shapes else set()
    expected |= moe_shapes
    for i in range(layers):
        p = f"model.layers.{i}."
        expected |= {p + "self_attn.o_proj.weight": (h, q_out)}
        if i not in sparse:
            expected[p + "mlp.down_proj.weight"] = (h, ffn)
        expected |= {p + norm + ".weight": (h,) for norm in LAYER_NORMS.get(config["model_type"], _LLAMA_NORMS)}
        if fused and p + "self_attn.q_proj.weight" not in tensors:  # phi3: attn_qkv (llama.cpp's converter)
            expected[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
            if config["attention_bias"]:
                expected[p + "self_attn.qkv_proj.bias"] = (q_out + 2 * kv_out,)
        else:
            expected |= {p + "self_attn.q_proj.weight": (q_out, h), p + "self_attn.k_proj.weight": (kv_out, h),
                         p + "self_attn.v_proj.weight": (kv_out, h)}
        if i in sparse:
            pass
        elif fused:
            expected[p + "mlp.gate_up_proj.weight"] = (2 * ffn, h)
        else:
            expected |= {p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h)}
        if config["attention_bias"] and p + "self_attn.qkv_proj.weight" not in expected:
            expected |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                         p + "self_attn.v_proj.bias": (kv_out,)}
            if qk_norm and p + "self_attn.o_proj.bias" in tensors:  # qwen3 attention_bias: o_proj too
                expected[p + "self_attn.o_proj.bias"] = (h,)
        if qk_norm:
            expected |= {p + "self_attn.q_norm.weight": (config["head_dim"],),
                         p + "self_attn.k_norm.weight": (config["head_dim"],)}
    if "lm_head.weight" in tensors:
        expected["lm_head.weight"] = (config["vocab_size"], h)
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelFormatError(f"{path.name}: tensor for {name!r} is missing from the GGUF file")
        got = tensors.shape(name)  # type: ignore[attr-defined]
        if got != shape:
            raise ModelFormatError(f"{path.name}: tensor {name!r} has shape {got}, the metadata implies {shape}")
    extra = sorted(set(tensors) - set(expected))
    stray_norms = [n for n in extra if n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]
    if stray_norms:
        raise ModelFormatError(
            f"{path.name}: {stray_norms[0]!r} (per-head q/k norm) belongs to a qwen3 model, but the file's "
            f"architecture is {config['model_type']!r}; octavo would ignore it and compute wrong attention"
        )
    if extra:
        log.warning("%s: ignoring GGUF tensors with no use in the model: %s", path.name, extra[:5])


_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    """EOS first, then end-of-turn / end-of-message ids when the file names different ones."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _opt_int(meta.get(key))
        if value is not None and value not in ids:
            ids.append(value)
    return ids


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
