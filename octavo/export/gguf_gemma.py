"""Gemma 2 / Gemma 3 text GGUF files (llama.cpp's "gemma2" / "gemma3") in HF terms.

GGUF facts (llama.cpp's converter and model loader):
- tensors: the Llama names plus the sandwich norms: `blk.N.post_attention_norm` (HF post_attention_layernorm),
  `blk.N.ffn_norm` (HF pre_feedforward_layernorm: the name Llama files use for the MLP's input norm),
  `blk.N.post_ffw_norm` (HF post_feedforward_layernorm); Gemma 3 also `blk.N.attn_q_norm` / `attn_k_norm`.
  q/k rows are not permuted (NeoX rope). The embedding is tied (no output.weight as a rule).
- every RMSNorm weight is stored with Gemma's 1 added (the converter writes w + 1; llama.cpp multiplies by
  it), so the HF weight is the stored value minus 1 (`NORM_OFFSET`);
- metadata: `<arch>.attention.sliding_window`, `.attn_logit_softcapping` / `.final_logit_softcapping`
  (Gemma 2), `.rope.freq_base` (Gemma 3: the global layers' base; linear `.rope.scaling.*` applies to them
  only). Not stored, fixed by llama.cpp: the local layers' base 10000 (read from `.rope.freq_base_swa` where
  a file has it), the layer pattern (every 2nd layer global for Gemma 2, every 6th for Gemma 3; a
  `.attention.sliding_window_pattern` array of per-layer booleans, true = sliding, wins; no window: 4096 for
  Gemma 2, full attention on every layer for Gemma 3) and the attention
  scale: query_pre_attn_scalar = hidden_size / heads for the 27B models (Gemma 2: 46 layers, Gemma 3: 62),
  head_dim otherwise (`.attention.scale`, where a file has it, wins). Embeddings are scaled by
  sqrt(hidden_size), the MLP is gelu_pytorch_tanh: both implied by the architecture.
"""
from __future__ import annotations

from typing import Any

from octavo.errors import ModelFormatError

GEMMA_GGUF_ARCHITECTURES = ("gemma2", "gemma3")
NORM_OFFSET = 1.0  # stored norm weight = HF weight + 1
# GGUF block part -> HF name, where a Gemma file differs from a Llama one
BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern: every Nth layer global
LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}  # llama.cpp's 27B: attention scale from hidden_size / heads
LOCAL_ROPE_BASE = 10_000.0
DEFAULT_WINDOW = {"gemma2": 4096}  # llama.cpp's window for a gemma2 file without the key


def is_gemma_norm(hf_name: str) -> bool:
    """An RMSNorm weight (stored with 1 added in a Gemma GGUF)."""
    return hf_name.endswith("norm.weight")


def layer_types(meta: dict[str, Any], arch: str, num_layers: int, name: str) -> list[str]:
    """Per layer "sliding_attention" / "full_attention": the file's sliding_window_pattern (booleans, or one
    period), else llama.cpp's default period for the architecture."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", DEFAULT_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
            raise ModelFormatError(f"{name}: {arch}.attention.sliding_window_pattern must hold one boolean per layer "
                                   f"({num_layers}), got {pattern!r}")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    period = int(pattern)
    if period <= 0:
        raise ModelFormatError(f"{name}: {arch}.attention.sliding_window_pattern must be positive, got {pattern!r}")
    return ["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(num_layers)]


def query_pre_attn_scalar(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> float:
    """1 / scale^2 of `.attention.scale` when the file has it, else llama.cpp's rule (module docstring)."""
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None:
        if float(scale) <= 0:
            raise ModelFormatError(f"{arch}.attention.scale must be positive, got {scale}")
        return float(scale) ** -2
    if config["num_hidden_layers"] == LAYERS_OF_27B[arch]:
        return float(config["hidden_size"] // config["num_attention_heads"])
    return float(config["head_dim"])


def gemma_config(meta: dict[str, Any], arch: str, config: dict[str, Any], name: str) -> dict[str, Any]:
    """CONFIG (the Llama-style keys read already) completed into a Gemma2Config / Gemma3TextConfig dict in
    transformers 4's layout (rope_theta + rope_scaling for the global layers, rope_local_base_freq)."""
    out = dict(config)
    out["hidden_act"] = out["hidden_activation"] = "gelu_pytorch_tanh"
    out["query_pre_attn_scalar"] = query_pre_attn_scalar(meta, arch, config)
    window = int(meta.get(f"{arch}.attention.sliding_window", DEFAULT_WINDOW.get(arch, 0)) or 0)
    if window > 0:
        out["layer_types"] = layer_types(meta, arch, config["num_hidden_layers"], name)
    else:  # llama.cpp: a gemma3 file without a window attends fully on every layer, with one rope base
        out["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    out["sliding_window"] = window or None
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.get(f"{arch}.{key}")
        out[key] = float(value) if value else None
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(meta.get(f"{arch}.rope.freq_base_swa", LOCAL_ROPE_BASE))
    return out
