"""A sparse layer's Mixture-of-Experts block as ONNX nodes: the router's logits as a float32 Gemm (HF's F.linear),
then ONE octavo.MoE node (plugins/onnxruntime/moe_op.cc: softmax, top-k, optional renormalisation, each expert over
only its routed rows, the weighted sum), plus Qwen2-MoE's shared expert, sigmoid(x . shared_expert_gate) times a
SwiGLU MLP, added after (transformers adds it in that order).

The experts' weights are written as two initializers per layer, `<prefix>experts.gate_up` [E, 2I, H] (each
expert's gate rows then its up rows) and `<prefix>experts.down` [E, H, I], in HF's [out, in] layout: the bytes of
the checkpoint's per-expert tensors back to back, nothing concatenated in memory. The experts stay float32 in
every export (the op has no quantized path yet); the router stays float32 so that routing is the checkpoint's.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from octavo.export.graph_builder import OP_DOMAIN, CheckpointTensors, Graph
from octavo.export.moe_spec import MoeSpec

MOE_OP = "MoE"


def _stacked(g: Graph, name: str, parts: list[np.ndarray], shape: tuple[int, int, int]) -> str:
    """PARTS written back to back as one [E, rows, cols] initializer NAME (no copy: their bytes are that tensor)."""
    tensor = g.weights.add(name, parts)
    del tensor.dims[:]
    tensor.dims.extend(shape)
    g.initializers.append(tensor)
    return name


def _experts(g: Graph, w: CheckpointTensors, moe: MoeSpec, layer: int, hidden: int) -> tuple[str, str]:
    """(gate_up, down) initializers of LAYER's experts, from per-expert tensors or the fused 3-D ones."""
    E, I, prefix = moe.num_experts, moe.expert_intermediate_size, moe.prefix(layer)  # noqa: E741 - HF's names
    fused_gate_up, fused_down = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
    names = w.checkpoint.tensor_names
    if fused_gate_up in names and fused_down in names:  # transformers 5's in-memory layout, saved as is
        gate_up = [w.get(fused_gate_up, (E, 2 * I, hidden)).reshape(E * 2 * I, hidden)]
        down = [w.get(fused_down, (E, hidden, I)).reshape(E * hidden, I)]
    else:
        gate_up, down = [], []
        for e in range(E):
            gate_up += [w.get(moe.expert(layer, e, "gate"), (I, hidden)), w.get(moe.expert(layer, e, "up"), (I, hidden))]
            down.append(w.get(moe.expert(layer, e, "down"), (hidden, I)))
    return (_stacked(g, prefix + "experts.gate_up", gate_up, (E, 2 * I, hidden)),
            _stacked(g, prefix + "experts.down", down, (E, hidden, I)))


def moe_block(g: Graph, w: CheckpointTensors, moe: MoeSpec, layer: int, hidden: int, h: str,
              swiglu: Callable[[str, str, int], str]) -> str:
    """LAYER's MoE block over the normed H [T, hidden]; SWIGLU(x, checkpoint prefix, intermediate size) builds a
    dense SwiGLU MLP (the shared expert)."""
    router = g.weight(moe.router(layer), [w.get(moe.router(layer), (moe.num_experts, hidden))])
    logits = g.op1("Gemm", [h, router], transB=1)
    gate_up, down = _experts(g, w, moe, layer, hidden)
    y = g.op1(MOE_OP, [h, logits, gate_up, down], domain=OP_DOMAIN, top_k=moe.top_k,
              normalize=int(moe.normalize_top_k))
    if not moe.shared_expert_intermediate_size:
        return y
    prefix = moe.prefix(layer)
    shared = swiglu(h, prefix + "shared_expert.", moe.shared_expert_intermediate_size)
    gate_name = prefix + "shared_expert_gate.weight"
    gate = g.op1("Sigmoid", [g.op1("Gemm", [h, g.weight(gate_name, [w.get(gate_name, (1, hidden))])], transB=1)])
    return g.op1("Add", [y, g.op1("Mul", [gate, shared])])
