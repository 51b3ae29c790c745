"""Rotary embedding inverse frequencies, computed at export time (default, linear, llama3, yarn and longrope
scaling).

The graph multiplies these by the position ids and takes cos/sin (rotate_half layout, as HF does),
so only `inv_freq` [head_dim / 2] float32 goes into the ONNX file.

YaRN (https://arxiv.org/abs/2309.00071, transformers' "yarn" rope type) also scales cos and sin by an
attention factor f. Since q and k are both rotated, that multiplies every q·k by f^2: the exporter folds
it into the attention node's `scale` (`attention_scale`) and leaves the rope subgraph untouched, so the
ONNX Runtime backend's rotary fusion still matches it.

LongRoPE (Phi-3.5 / Phi-4-mini, transformers' "longrope") divides each frequency by a per-dimension factor:
transformers picks `long_factor` when the sequence is longer than `original_max_position_embeddings`,
`short_factor` otherwise, for every position of the batch. A paged KV cache keeps keys rotated once, so
the set is fixed per engine, by vLLM's rule: long when the context exceeds the original one. The export
writes the set of the model's full context (max_position_embeddings; `complete_longrope` records it as
`factors`); an ONNX Runtime engine with a smaller max_model_len swaps the table
(octavo.runtime.backends.longrope_table). Its attention factor multiplies cos and sin like YaRN's.
Partial rotary (`rotary_dim` < head_dim: the first rotary_dim values of each head turn, the rest pass) takes
tables of rotary_dim / 2 frequencies.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

YARN_BETA_FAST = 32.0  # transformers' defaults (the paper's alpha / beta)
YARN_BETA_SLOW = 1.0


def default_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    """1 / theta^(2i/d), rounded to float32 like transformers' float32 computation."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (theta ** exponents.astype(np.float64))).astype(np.float32)


def _llama3(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    inv = inv_freq.astype(np.float64)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)  # long waves: divide by factor
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """The paper's sqrt(1/t) fit: 0.1 * mscale * ln(factor) + 1 (1 when the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def complete_yarn(scaling: dict[str, Any], max_position_embeddings: int,
                  top_level_original: int | None = None) -> dict[str, Any]:
    """SCALING (a "yarn" dict from config.json) with every default transformers would use written out.

    - original_max_position_embeddings: a top-level config entry of that name wins (transformers gives it
      priority), then the dict's own, then max_position_embeddings;
    - factor missing or null: max_position_embeddings / original_max_position_embeddings;
    - attention_factor missing or null: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
      are set (and non-zero), else mscale(factor);
    - beta_fast / beta_slow missing, null or 0: 32 / 1; truncate missing: true.
    """
    out = dict(scaling)
    original = top_level_original or out.get("original_max_position_embeddings") or max_position_embeddings
    out["original_max_position_embeddings"] = int(original)
    if out.get("factor") is None:
        out["factor"] = max_position_embeddings / int(original)
    factor = float(out["factor"])
    if out.get("attention_factor") is None:
        mscale, mscale_all_dim = out.get("mscale"), out.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            out["attention_factor"] = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            out["attention_factor"] = _yarn_mscale(factor)
    out["beta_fast"] = float(out.get("beta_fast") or YARN_BETA_FAST)
    out["beta_slow"] = float(out.get("beta_slow") or YARN_BETA_SLOW)
    out["truncate"] = bool(out.get("truncate", True))
    return out


def complete_longrope(scaling: dict[str, Any], max_position_embeddings: int,
                      top_level_original: int | None = None) -> dict[str, Any]:
    """SCALING (a "longrope" dict) with transformers' defaults written out and octavo's choice of factors:
    original_max_position_embeddings (the top-level config entry wins, as in transformers), factor (missing:
    max_position_embeddings / original), attention_factor (missing: sqrt(1 + ln factor / ln original), 1 when
    factor <= 1) and factors = "long" when max_position_embeddings > original, else "short"."""
    out = dict(scaling)
    original = top_level_original or out.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope scaling needs original_max_position_embeddings")
    out["original_max_position_embeddings"] = int(original)
    for key in ("short_factor", "long_factor"):
        values = out.get(key)
        if not isinstance(values, list) or not values or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise ValueError(f"longrope {key} must be a list of positive numbers, got {values!r}")
        out[key] = [float(v) for v in values]
    if out.get("factor") is None:
        out["factor"] = max_position_embeddings / int(original)
    factor = float(out["factor"])
    if out.get("attention_factor") is None:
        out["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
    out["factors"] = "long" if max_position_embeddings > int(original) else "short"
    return out


def _longrope(theta: float, dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """1 / (factor_i * theta^(2i/d)) with the chosen factor set, float32 in transformers' order."""
    factors = np.asarray(scaling["long_factor" if scaling.get("factors") == "long" else "short_factor"], np.float32)
    if factors.shape != (dim // 2,):
        raise ValueError(f"longrope factors have {factors.size} values, the rotary dimension {dim} needs {dim // 2}")
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = (theta ** exponents.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) / (factors * pos_freqs)).astype(np.float32)


def _completed(scaling: dict[str, Any]) -> dict[str, Any]:
    """A yarn dict with its defaults filled in; factor and original context must be there already
    (spec_from_config completes the config's dict with complete_yarn, which knows the model's context)."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
    if missing:
        raise ValueError(f"yarn rope scaling lacks {missing}: complete it with complete_yarn first")
    return complete_yarn(scaling, int(scaling["original_max_position_embeddings"]))


def _yarn_correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """The dimension index whose wave turns ROTATIONS times over CONTEXT positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per dimension: interpolated (divided by factor) below the correction range, kept (extrapolated)
    above it, a linear ramp between. float32 arithmetic in transformers' order: equal to its float32
    tensors, except that theta^(2i/d) is rounded correctly here and torch's float32 pow is at times 1 ulp off."""
    yarn = _completed(scaling)
    factor, context = float(yarn["factor"]), int(yarn["original_max_position_embeddings"])
    low = _yarn_correction_dim(yarn["beta_fast"], head_dim, theta, context)
    high = _yarn_correction_dim(yarn["beta_slow"], head_dim, theta, context)
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp

    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = (theta ** exponents.astype(np.float64)).astype(np.float32)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = np.float32(1.0) - np.clip(ramp, np.float32(0.0), np.float32(1.0))  # 1: extrapolate, 0: interpolate
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def inv_freq(theta: float, head_dim: int, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] float32 for the given rope scaling (None = default); HEAD_DIM is the
    rotary dimension (partial rotary: the rotated part of a head)."""
    if scaling is None:
        return default_inv_freq(theta, head_dim)
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (default_inv_freq(theta, head_dim).astype(np.float64) / float(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        return _llama3(default_inv_freq(theta, head_dim), scaling)
    if rope_type == "yarn":
        return _yarn(theta, head_dim, scaling)
    if rope_type == "longrope":
        return _longrope(theta, head_dim, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")  # spec_from_config refuses these first


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor transformers multiplies cos and sin by (1 except for yarn and longrope)."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling["rope_type"] == "longrope":
        return float(scaling["attention_factor"])  # complete_longrope wrote it
    return float(_completed(scaling)["attention_factor"])


def attention_scale(head_dim: int, scaling: dict[str, Any] | None) -> float:
    """The attention node's q·k scale: 1/sqrt(head_dim), times attention_factor^2 (cos and sin both carry it)."""
    return attention_factor(scaling) ** 2 / math.sqrt(head_dim)
