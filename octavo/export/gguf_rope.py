"""RoPE scaling of a GGUF file as a HF `rope_scaling` dict.

GGUF facts: `<arch>.rope.scaling.type` ("none" | "linear" | "yarn"), `.rope.scaling.factor`,
`.rope.scaling.original_context_length` (older files: `.rope.scale_linear`); for yarn optionally
`.rope.scaling.yarn_beta_fast` / `.yarn_beta_slow` (and multipliers, refused unless neutral).
Llama 3.1-style scaling is not stored as metadata: llama.cpp's converter writes the per-frequency divisors
as a tensor `rope_freqs.weight` (head_dim/2 values). We recover the HF "llama3" parameters by finding the
(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) whose divisors reproduce it.
LongRoPE (Phi-3.5 / Phi-4-mini 128k) is stored as the tensors `rope_factors_long.weight` /
`rope_factors_short.weight` (the factors, rotary_dim / 2 each) with `.rope.scaling.original_context_length`
and `.rope.scaling.attn_factor` (the cos/sin factor llama.cpp applies; absent: transformers' default).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from octavo.errors import ModelFormatError


def llama3_divisors(head_dim: int, theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The divisor HF's "llama3" rope applies to each inverse frequency (1 = unchanged)."""
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def rope_scaling_from_gguf(meta: dict[str, Any], reader: Any, arch: str, head_dim: int, theta: float,
                           name: str) -> dict[str, Any] | None:
    """HF rope_scaling for the file, or None when it has none."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    factors = {str(t.name): t for t in reader.tensors if str(t.name) in LONGROPE_TENSORS}
    if factors:
        return _longrope(meta, arch, factors, original, name)
    if freqs is not None:
        return _fit_llama3(np.asarray(freqs.data, dtype=np.float64).reshape(-1), head_dim, theta, name)
    if kind in (None, "none") and factor in (None, 1.0):
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return _yarn(meta, arch, factor, original, name)
    raise ModelFormatError(f"{name}: rope scaling type {kind!r} is not supported (supported: linear, yarn, llama3)")


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _longrope(meta: dict[str, Any], arch: str, factors: dict[str, Any], original: Any, name: str) -> dict[str, Any]:
    """HF "longrope" from llama.cpp's rope_factors tensors and keys."""
    missing = [t for t in LONGROPE_TENSORS if t not in factors]
    if missing:
        raise ModelFormatError(f"{name}: longrope needs both rope factor tensors; {missing[0]!r} is missing")
    if original is None:
        raise ModelFormatError(f"{name}: longrope needs {arch}.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
    for tensor_name, key in zip(LONGROPE_TENSORS, ("long_factor", "short_factor")):
        scaling[key] = [float(v) for v in np.asarray(factors[tensor_name].data, dtype=np.float64).reshape(-1)]
    attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def _yarn(meta: dict[str, Any], arch: str, factor: Any, original: Any, name: str) -> dict[str, Any]:
    """HF "yarn" from llama.cpp's keys. llama.cpp always truncates the correction range (HF's default) and
    scales cos/sin by yarn_attn_factor x (1 + 0.1 ln factor); only the default multiplier (1) and the
    default ramp (ext_factor -1 / 1) are HF's yarn, so other values are refused rather than guessed."""
    if factor is None:
        raise ModelFormatError(f"{name}: yarn rope scaling without {arch}.rope.scaling.factor")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    if original is not None:  # absent: the context length, as in llama.cpp and transformers
        scaling["original_max_position_embeddings"] = int(original)
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = meta.get(f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[hf] = float(value)
    neutral = {"yarn_attn_factor": (1.0,), "attn_factor": (1.0,), "yarn_ext_factor": (-1.0, 1.0),
               "yarn_log_multiplier": (0.0,)}
    for key, allowed in neutral.items():
        value = meta.get(f"{arch}.rope.scaling.{key}")
        if value is not None and float(value) not in allowed:
            raise ModelFormatError(
                f"{name}: {arch}.rope.scaling.{key} = {value} changes YaRN in a way octavo does not reproduce; "
                "export the model from its HF checkpoint instead (config.json's rope_scaling is supported)"
            )
    return scaling


def _fit_llama3(divisors: np.ndarray, head_dim: int, theta: float, name: str) -> dict[str, Any]:
    if divisors.shape != (head_dim // 2,):
        raise ModelFormatError(f"{name}: rope_freqs.weight has {divisors.size} values, expected {head_dim // 2}")
    factor = float(divisors.max())
    originals = [2 ** k for k in range(4, 21)]
    for low, high, original in itertools.product((1.0, 2.0), (4.0, 8.0, 2.0), originals):
        if high <= low:
            continue
        want = llama3_divisors(head_dim, theta, factor, low, high, original)
        if np.allclose(want, divisors, rtol=1e-4, atol=1e-5):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise ModelFormatError(
        f"{name}: rope_freqs.weight holds per-frequency RoPE factors that match no Llama-3 rope_scaling; "
        "octavo cannot express them"
    )
