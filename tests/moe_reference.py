"""numpy reference of octavo.MoE (plugins/onnxruntime/moe_kernel.h), written from transformers' MoE blocks, not
from the C++: float64 softmax over the router logits, the top_k experts (ties: the lower expert index, the op's
documented rule), optional renormalisation, and the weighted sum of SwiGLU experts, every expert over all of its
tokens at once."""
from __future__ import annotations

import numpy as np


def route(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(experts [T, top_k], weights [T, top_k]) of each token; experts in descending probability, ties by index."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    # a stable sort of -p keeps equal probabilities in index order
    experts = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(p, experts, axis=1)
    if normalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return experts, weights


def moe(x: np.ndarray, logits: np.ndarray, gate_up: np.ndarray, down: np.ndarray, top_k: int,
        normalize: bool) -> np.ndarray:
    """y [T, H] in float64 for x [T, H], logits [T, E], gate_up [E, 2I, H], down [E, H, I]."""
    experts, weights = route(logits, top_k, normalize)
    x64 = x.astype(np.float64)
    inter = gate_up.shape[1] // 2
    y = np.zeros_like(x64)
    for e in range(gate_up.shape[0]):
        tokens, choice = np.nonzero(experts == e)
        if tokens.size == 0:
            continue
        h = x64[tokens] @ gate_up[e].astype(np.float64).T
        gate, up = h[:, :inter], h[:, inter:]
        with np.errstate(over="ignore"):  # exp(-gate) = inf for a very negative gate: silu is then -0
            act = gate / (1.0 + np.exp(-gate)) * up
        y[tokens] += (act @ down[e].astype(np.float64).T) * weights[tokens, choice][:, None]
    return y
