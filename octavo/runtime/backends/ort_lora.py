"""LoRA in the ONNX Runtime graph: a load-time rewrite that adds every adapter's low-rank product to the projections,
row by row, in one pass for all adapters of a step (punica's idea with plain ONNX ops).

For each float32 projection Gemm of a layer (the fused q/k/v, o_proj, the fused gate/up, down_proj) the rewrite adds

    y += ((x @ A^T) * mask) @ B^T,   A [C, in], B [out, C], C = max_loras x parts x max_lora_rank,

where column c of A/B belongs to adapter slot c // (parts x rank) + 1 and mask[t, c] = 1 when token t's row asked
for that slot (the graph input `lora_slots` [T], 0 = the base model: all-zero mask, nothing added). A and B are
graph inputs (`lora_a.<weight>`, `lora_b.<weight>`) bound once to numpy arrays the backend owns (LoraPools), so
loading an adapter into a slot is a copy into those arrays; a fused projection keeps each part's adapter in its
own columns and rows (q's B only writes q's outputs). Quantized exports are refused: the LoRA sits on float Gemms.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from octavo.errors import ModelFormatError
from octavo.runtime.lora import LoRAAdapter

SLOTS_INPUT = "lora_slots"
# the export's fused weight -> the HF modules stacked in it, in order
_PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
          "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}
_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.gate_up_proj|mlp\.down_proj)"
                     r"\.weight$")


@dataclass(slots=True)
class LoraSite:
    """One projection with LoRA: its weight's name, layer, in/out sizes and the sizes of its stacked parts."""

    weight: str
    layer: int
    kind: str  # "self_attn.qkv_proj", ...
    in_dim: int
    part_sizes: list[int]

    @property
    def modules(self) -> list[str]:
        prefix = f"model.layers.{self.layer}.{self.kind.split('.')[0]}."
        return [prefix + part for part in _PARTS[self.kind]]


def add_lora_branches(model: onnx.ModelProto, max_loras: int, max_rank: int) -> list[LoraSite]:
    """Rewrite MODEL in place (see the module docstring); returns the sites, in graph order."""
    graph = model.graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    nodes, sites = list(graph.node), []
    out: list[onnx.NodeProto] = []
    renamed: dict[str, str] = {}
    masks: dict[int, str] = {}
    mask_nodes: list[onnx.NodeProto] = []
    for node in nodes:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        out.append(node)
        m = _WEIGHT.match(node.input[1]) if len(node.input) > 1 else None
        if m is None:
            continue
        if node.op_type != "Gemm":
            raise ModelFormatError(f"LoRA needs a float32 export: {node.input[1]} runs as {node.op_type} (re-export "
                                   "with --weights fp32)")
        out_dim, in_dim = shapes[node.input[1]]
        parts = _PARTS[m.group(2)]
        site = LoraSite(node.input[1], int(m.group(1)), m.group(2), in_dim, _part_sizes(m.group(2), out_dim, graph))
        if sum(site.part_sizes) != out_dim or len(site.part_sizes) != len(parts):
            raise ModelFormatError(f"cannot split {site.weight} [{out_dim}, {in_dim}] into {parts}")
        sites.append(site)
        cols = max_loras * len(parts) * max_rank
        if len(parts) not in masks:
            masks[len(parts)] = _mask(graph, mask_nodes, max_loras, len(parts), max_rank)
        a, b = f"lora_a.{site.weight}", f"lora_b.{site.weight}"
        graph.input.append(helper.make_tensor_value_info(a, TensorProto.FLOAT, [cols, in_dim]))
        graph.input.append(helper.make_tensor_value_info(b, TensorProto.FLOAT, [out_dim, cols]))
        y, base = node.output[0], f"lora.{site.weight}"
        out += [helper.make_node("Gemm", [node.input[0], a], [base + ".xa"], name=base + ".xa", transB=1),
                helper.make_node("Mul", [base + ".xa", masks[len(parts)]], [base + ".masked"], name=base + ".masked"),
                helper.make_node("Gemm", [base + ".masked", b], [base + ".delta"], name=base + ".delta", transB=1),
                helper.make_node("Add", [y, base + ".delta"], [base + ".y"], name=base + ".y")]
        renamed[y] = base + ".y"
    if not sites:
        raise ModelFormatError("the graph has no projection LoRA can adapt")
    slots = helper.make_node("Unsqueeze", [SLOTS_INPUT, "lora.axis1"], ["lora.slots_col"], name="lora.slots_col")
    del graph.node[:]
    graph.node.extend([slots, *mask_nodes, *out])
    graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "lora.axis1"))
    graph.input.append(helper.make_tensor_value_info(SLOTS_INPUT, TensorProto.INT64, ["num_tokens"]))
    return sites


def _part_sizes(kind: str, out_dim: int, graph: onnx.GraphProto) -> list[int]:
    """The sizes of the fused projection's parts, read from the export's shared split constants."""
    split = {"self_attn.qkv_proj": "const.split_qkv", "mlp.gate_up_proj": "const.split_mlp"}.get(kind)
    if split is None:
        return [out_dim]
    for t in graph.initializer:
        if t.name == split:
            return [int(v) for v in numpy_helper.to_array(t)]
    raise ModelFormatError(f"the export has no {split} constant to split {kind}")


def _mask(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], max_loras: int, parts: int, max_rank: int) -> str:
    """The name of the [T, C] float mask for projections of PARTS parts; its nodes are appended to NODES (they
    go first in the graph)."""
    name = f"lora.mask{parts}"
    cols = np.repeat(np.arange(1, max_loras + 1, dtype=np.int64), parts * max_rank)
    graph.initializer.append(numpy_helper.from_array(cols, f"lora.col_slots{parts}"))
    nodes.append(helper.make_node("Equal", ["lora.slots_col", f"lora.col_slots{parts}"], [name + ".eq"],
                                  name=name + ".eq"))
    nodes.append(helper.make_node("Cast", [name + ".eq"], [name], name=name, to=TensorProto.FLOAT))
    return name


@dataclass(slots=True)
class LoraPools:
    """The A/B arrays of every site (bound once as graph inputs) and what each slot holds."""

    sites: list[LoraSite]
    max_loras: int
    max_rank: int
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]

    @classmethod
    def zeros(cls, sites: list[LoraSite], max_loras: int, max_rank: int) -> "LoraPools":
        a, b = {}, {}
        for s in sites:
            cols = max_loras * len(s.part_sizes) * max_rank
            a[s.weight] = np.zeros((cols, s.in_dim), np.float32)
            b[s.weight] = np.zeros((sum(s.part_sizes), cols), np.float32)
        return cls(sites, max_loras, max_rank, a, b)

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write ADAPTER's weights into SLOT (1..max_loras); None clears the slot."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} outside 1..{self.max_loras}")
        used: set[str] = set()
        for s in self.sites:
            parts, r = len(s.part_sizes), self.max_rank
            row = 0
            for p, (module, size) in enumerate(zip(s.modules, s.part_sizes)):
                c0 = ((slot - 1) * parts + p) * r
                self.a[s.weight][c0:c0 + r] = 0.0
                self.b[s.weight][:, c0:c0 + r] = 0.0
                pair = adapter.weights.get(module) if adapter is not None else None
                if pair is not None:
                    a, b = pair
                    if a.shape[1] != s.in_dim or b.shape[0] != size:
                        raise ModelFormatError(f"adapter {adapter.name!r}: {module} has A {a.shape} and B {b.shape}; "
                                               f"the model's projection is [{size}, {s.in_dim}]")
                    self.a[s.weight][c0:c0 + a.shape[0]] = a
                    self.b[s.weight][row:row + size, c0:c0 + a.shape[0]] = b
                    used.add(module)
                row += size
        if adapter is not None and set(adapter.weights) - used:
            missing = sorted(set(adapter.weights) - used)
            raise ModelFormatError(f"adapter {adapter.name!r} adapts {missing[:3]}, which this model does not have")


__all__ = ["SLOTS_INPUT", "LoraPools", "LoraSite", "add_lora_branches"]
