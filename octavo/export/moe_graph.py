"""A sparse layer's Mixture-of-Experts block as ONNX nodes: the router's logits as a float32 Gemm (HF's F.linear),
then ONE octavo.MoE node (plugins/onnxruntime/moe_op.cc: softmax, top-k, optional renormalisation, each expert over
only its routed rows, the weighted sum), plus Qwen2-MoE's shared expert, sigmoid(x . shared_expert_gate) times a
SwiGLU MLP, added after (transformers adds it in that order).

Float experts are two initializers per layer, `<prefix>experts.gate_up` [E, 2I, H] (each expert's gate rows then
its up rows) and `<prefix>experts.down` [E, H, I], in HF's [out, in] layout: the bytes of the checkpoint's
per-expert tensors back to back, nothing concatenated in memory. A quantized GGUF's experts (with "gguf" weights and
the block kernel) stay in the file's own blocks instead, re-laid per expert for the BlockMatMul kernel
(octavo.export.moe_blocks): `<prefix>experts.{gate_up,down}.{codes,scales,offsets}`. octavo's own int8/int4
quantization leaves the experts float32. The router is float32 in every export, so routing is the checkpoint's.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx

from octavo.errors import ModelFormatError
from octavo.export.graph_builder import OP_DOMAIN, CheckpointTensors, Graph
from octavo.export.moe_blocks import StackedPanels, stack_experts
from octavo.export.moe_spec import MoeSpec
from octavo.export.projection import decode_step
from octavo.export.quantize import QuantConfig

log = logging.getLogger(__name__)

MOE_OP = "MoE"


def _stacked(g: Graph, name: str, parts: list[np.ndarray], shape: tuple[int, int, int]) -> str:
    """PARTS written back to back as one [E, rows, cols] initializer NAME (no copy: their bytes are that tensor)."""
    tensor = g.weights.add(name, parts)
    del tensor.dims[:]
    tensor.dims.extend(shape)
    g.initializers.append(tensor)
    return name


def _float_experts(g: Graph, w: CheckpointTensors, moe: MoeSpec, layer: int, hidden: int) -> list[str]:
    """[gate_up, down] float32 initializers of LAYER's experts: from per-expert tensors (HF), the fused 3-D ones
    (transformers 5's layout) or a GGUF's 3-D gate / up / down tensors (their values, dequantized)."""
    E, I, prefix = moe.num_experts, moe.expert_intermediate_size, moe.prefix(layer)  # noqa: E741 - HF's names
    names = w.checkpoint.tensor_names
    fused_gate_up, fused_down = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
    gate3, up3, down3 = (prefix + f"experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
    if fused_gate_up in names and fused_down in names:  # transformers 5's in-memory layout, saved as is
        gate_up = [w.get(fused_gate_up, (E, 2 * I, hidden)).reshape(E * 2 * I, hidden)]
        down = [w.get(fused_down, (E, hidden, I)).reshape(E * hidden, I)]
    elif gate3 in names:  # a GGUF's ffn_{gate,up,down}_exps
        gates, ups = w.get(gate3, (E, I, hidden)), w.get(up3, (E, I, hidden))
        gate_up = [part for e in range(E) for part in (gates[e], ups[e])]
        down = [w.get(down3, (E, hidden, I)).reshape(E * hidden, I)]
    else:
        gate_up, down = [], []
        for e in range(E):
            gate_up += [w.get(moe.expert(layer, e, "gate"), (I, hidden)), w.get(moe.expert(layer, e, "up"), (I, hidden))]
            down.append(w.get(moe.expert(layer, e, "down"), (hidden, I)))
    return [_stacked(g, prefix + "experts.gate_up", gate_up, (E, 2 * I, hidden)),
            _stacked(g, prefix + "experts.down", down, (E, hidden, I))]


def _expert_blocks(w: CheckpointTensors, moe: MoeSpec, layer: int, hidden: int) -> tuple[StackedPanels, StackedPanels] | None:
    """(gate_up, down) of LAYER's experts in the file's own blocks (a GGUF's 3-D tensors), or None where the file
    has no exact block layout for them (float types, Q2_K, Q3_K, IQ4_*: the experts are then float32)."""
    E, I, prefix = moe.num_experts, moe.expert_intermediate_size, moe.prefix(layer)  # noqa: E741 - HF's names
    names = [prefix + f"experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    if not all(n in w.checkpoint.tensor_names for n in names):
        return None
    found = [w.checkpoint.blocks(n) for n in names]
    if any(b is None for b in found):
        return None
    gate, up, down = found
    for name, b, shape in zip(names, found, [(E * I, hidden), (E * I, hidden), (E * hidden, I)]):
        if (b.n, b.k) != shape:
            raise ModelFormatError(f"{w.checkpoint.source}: tensor {name!r} holds {(b.n, b.k)} rows x columns, the "
                                   f"config implies {shape}")
    try:
        return (stack_experts([[gate.rows(slice(e * I, (e + 1) * I)), up.rows(slice(e * I, (e + 1) * I))]
                               for e in range(E)]),
                stack_experts([[down.rows(slice(e * hidden, (e + 1) * hidden))] for e in range(E)]))
    except ValueError as exc:  # a block size the kernel cannot take (not a multiple of 4): float32 instead
        log.info("layer %d: experts kept float32 (%s)", layer, exc)
        return None


def _block_experts(g: Graph, moe: MoeSpec, layer: int, gate_up: StackedPanels, down: StackedPanels) -> tuple[
        list[str], dict[str, int]]:
    """The MoE node's inputs 2-12 and attributes for experts in the file's own blocks (moe_op.cc)."""
    p = moe.prefix(layer) + "experts."
    scale = {np.dtype(np.float16): "f2", np.dtype(np.float32): "f4", np.dtype(np.int8): "i1"}
    inputs = [g.weight(p + "gate_up.codes", [gate_up.codes], "u1"), g.weight(p + "down.codes", [down.codes], "u1"),
              g.weight(p + "gate_up.scales", [gate_up.scales], scale[gate_up.scales.dtype]),
              g.weight(p + "gate_up.offsets", [gate_up.offsets], scale[gate_up.offsets.dtype]),
              g.weight(p + "down.scales", [down.scales], scale[down.scales.dtype]),
              g.weight(p + "down.offsets", [down.offsets], scale[down.offsets.dtype]), decode_step(g)]
    for name, panels in (("gate_up", gate_up), ("down", down)):  # inputs 9-12: two-level scales' float32 supers
        if panels.scale_super is None:
            inputs += ["", ""]
        else:
            inputs += [g.weight(p + name + ".scale_super", [panels.scale_super]),
                       g.weight(p + name + ".offset_super", [panels.offset_super])]
    while inputs[-1] == "":
        inputs.pop()
    attrs = dict(expert_inter=moe.expert_intermediate_size, gate_up_bits=gate_up.bits,
                 gate_up_block_size=gate_up.block_size, down_bits=down.bits, down_block_size=down.block_size)
    return inputs, attrs


def moe_block(g: Graph, w: CheckpointTensors, moe: MoeSpec, layer: int, hidden: int, h: str,
              swiglu: Callable[[str, str, int], str], quant: QuantConfig | None) -> str:
    """LAYER's MoE block over the normed H [T, hidden]; SWIGLU(x, checkpoint prefix, intermediate size) builds a
    dense SwiGLU MLP (the shared expert). QUANT "gguf" with the block kernel: the experts in the file's own blocks."""
    router = g.weight(moe.router(layer), [w.get(moe.router(layer), (moe.num_experts, hidden))])
    logits = g.op1("Gemm", [h, router], transB=1)
    blocks = _expert_blocks(w, moe, layer, hidden) if quant is not None and quant.native and quant.block_kernel else None
    if blocks is not None:
        experts, attrs = _block_experts(g, moe, layer, *blocks)
    else:
        experts, attrs = _float_experts(g, w, moe, layer, hidden), {}
    y = g.op1(MOE_OP, [h, logits, *experts], domain=OP_DOMAIN, top_k=moe.top_k, normalize=int(moe.normalize_top_k),
              **attrs)
    if not moe.shared_expert_intermediate_size:
        return y
    prefix = moe.prefix(layer)
    shared = swiglu(h, prefix + "shared_expert.", moe.shared_expert_intermediate_size)
    gate_name = prefix + "shared_expert_gate.weight"
    gate_weight = w.checkpoint.tensor(gate_name)
    if gate_weight.shape != (hidden,):  # HF's [1, H] (checked here); a GGUF's ffn_gate_inp_shexp is [H]
        gate_weight = w.get(gate_name, (1, hidden))
    gate = g.op1("Sigmoid", [g.op1("Gemm", [h, g.weight(gate_name, [gate_weight.reshape(1, hidden)])], transB=1)])
    return g.op1("Add", [y, g.op1("Mul", [gate, shared])])


def expert_weights(model: onnx.ModelProto) -> str:
    """What the written graph's experts are: "gguf" (the file's own blocks) or "float32" (for the manifest)."""
    blocks = any(a.name == "expert_inter" for n in model.graph.node if n.op_type == MOE_OP for a in n.attribute)
    return "gguf" if blocks else "float32"
