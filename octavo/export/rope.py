"""Rotary embedding inverse frequencies, computed at export time (default, linear and llama3 scaling).

The graph multiplies these by the position ids and takes cos/sin (rotate_half layout, as HF does),
so only `inv_freq` [head_dim / 2] float32 goes into the ONNX file.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


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


def inv_freq(theta: float, head_dim: int, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] float32 for the given rope scaling (None = default)."""
    base = default_inv_freq(theta, head_dim)
    if scaling is None:
        return base
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (base.astype(np.float64) / float(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        return _llama3(base, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")  # spec_from_config refuses these first
