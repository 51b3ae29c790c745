"""Graph rewrites the ONNX Runtime backend applies to the loaded graph in memory (the export on disk, the
ONNX contract and the TensorRT path are unchanged). Besides the rotary fusions below: `set_int8_activations`, the
BlockMatMul / MoE attributes of EngineArgs.prompt_activations / decode_activations = "int8".

Rotary embedding: the exporter writes RoPE as plain ONNX so that every runtime can read it — per q and k
of every layer Reshape -> Split -> Neg -> Concat -> Mul(cos) / Mul(sin) -> Add -> Reshape, eight nodes
(with the shared angle/cos/sin nodes, about half of a Llama graph's nodes). ONNX Runtime's graph
optimizer does not fuse that pattern, and at small batch a decode step is dominated by per-node
dispatch rather than by the arithmetic. `fuse_rotary` replaces each occurrence with one
`com.microsoft.RotaryEmbedding` (rotate-half form, `interleaved=0`) between an Unsqueeze and a Squeeze
(the step's T tokens as a batch of T sequences of one token, each with its own position: ORT bounds the
sequence length by the table's rows, and a packed step can hold more tokens than the context length),
reading cos/sin tables of every position up to the model's context length, computed in float32 exactly
as the graph computes its angles (float32(position) x inv_freq, then cos / sin).

A model may have several rotary tables (Gemma 3: `rope.inv_freq` for its global layers and
`rope.inv_freq.local` for its sliding layers): every initializer named `rope.inv_freq` or
`rope.inv_freq.<suffix>` is a table, and each occurrence is fused with cos/sin caches built from the table
its angles are computed from (`rope.cos_cache<.suffix>`, `rope.sin_cache<.suffix>`).

Rotary embedding into attention: `fuse_rotary_into_attention` then moves each layer's two fused nodes
(Unsqueeze -> RotaryEmbedding -> Squeeze for q and for k) into its octavo.PagedAttention node, as the op's
optional inputs position_ids, cos_cache and sin_cache (plugins/onnxruntime/paged_attention_op.cc rotates q and k
before anything reads them, with the graph's rotate-half arithmetic): six nodes a layer fewer (180 of SmolLM2's
518 per step), which at batch 1 are dispatch, not arithmetic. Only where both chains read the same tables and
positions, rotate all of head_dim in rotate-half form with the attention node's head counts, and feed nothing
else.

A pattern that does not match exactly (another exporter version, a different rope) is left as it is:
the rewrite is an optimisation, never a requirement.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
INV_FREQ = "rope.inv_freq"
MAX_TABLE_BYTES = 256 << 20  # cos + sin tables (all of them together) larger than this: keep the unfused graph


@dataclass(slots=True)
class _Index:
    """Who produces and who consumes each value of a graph."""

    producer: dict[str, onnx.NodeProto]
    consumers: dict[str, list[onnx.NodeProto]]
    graph_outputs: set[str]

    @classmethod
    def of(cls, nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> _Index:
        producer: dict[str, onnx.NodeProto] = {}
        consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in nodes:
            for name in node.output:
                producer[name] = node
            for name in node.input:
                consumers[name].append(node)
        return cls(producer, consumers, {o.name for o in graph.output})

    def only_use(self, value: str, op_type: str) -> onnx.NodeProto | None:
        """The single consumer of VALUE if it is an OP_TYPE node and VALUE is not a graph output."""
        users = self.consumers.get(value, [])
        if len(users) != 1 or users[0].op_type != op_type or value in self.graph_outputs:
            return None
        return users[0]

    def made_by(self, value: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(value)
        return node if node is not None and node.op_type == op_type else None


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _is_table(name: str) -> bool:
    """rope.inv_freq or rope.inv_freq.<suffix>: an inverse-frequency table the exporter wrote."""
    return name == INV_FREQ or (name.startswith(INV_FREQ + ".") and len(name) > len(INV_FREQ) + 1)


def _angles_from_positions(index: _Index, angles: str, tables: dict[str, np.ndarray]) -> str | None:
    """The table T if ANGLES = Unsqueeze(Concat(h, h)), h = Mul(Unsqueeze(Cast(position_ids)), T), else None."""
    unsq = index.made_by(angles, "Unsqueeze")
    concat = index.made_by(unsq.input[0], "Concat") if unsq is not None else None
    if concat is None or len(concat.input) != 2 or concat.input[0] != concat.input[1]:
        return None
    mul = index.made_by(concat.input[0], "Mul")
    if mul is None or len(mul.input) != 2:
        return None
    table = next((name for name in mul.input if name in tables), None)
    if table is None:
        return None
    pos = mul.input[0] if mul.input[1] == table else mul.input[1]
    unsq_pos = index.made_by(pos, "Unsqueeze")
    cast = index.made_by(unsq_pos.input[0], "Cast") if unsq_pos is not None else None
    return table if cast is not None and cast.input[0] == "position_ids" else None


@dataclass(slots=True)
class _Rope:
    """One matched occurrence: the nodes to drop, its input, its output, its head count and its table."""

    nodes: list[onnx.NodeProto]
    source: str
    result: str
    heads: int
    table: str  # the rope.inv_freq[.suffix] initializer its angles come from


def _match(index: _Index, reshape: onnx.NodeProto, inits: dict[str, np.ndarray],
           tables: dict[str, np.ndarray]) -> _Rope | None:
    shape = inits.get(reshape.input[1])
    if shape is None or shape.ndim != 1 or len(shape) != 3:
        return None
    shaped = reshape.output[0]
    users = index.consumers.get(shaped, [])
    split = next((u for u in users if u.op_type == "Split"), None)
    mul_cos = next((u for u in users if u.op_type == "Mul"), None)
    if len(users) != 2 or split is None or mul_cos is None or _attr(split, "axis") != 2 or len(split.output) != 2:
        return None
    half = inits.get(split.input[1]) if len(split.input) > 1 else None
    if half is None or len(half) != 2 or half[0] != half[1] or 2 * int(half[0]) != int(shape[2]):
        return None
    x1, x2 = split.output
    neg = index.only_use(x2, "Neg")
    concat = index.only_use(neg.output[0], "Concat") if neg is not None else None
    if concat is None or list(concat.input) != [neg.output[0], x1] or _attr(concat, "axis") != 2 \
            or len(index.consumers.get(x1, [])) != 1:
        return None
    mul_sin = index.only_use(concat.output[0], "Mul")
    if mul_sin is None:
        return None
    cos = mul_cos.input[1] if mul_cos.input[0] == shaped else mul_cos.input[0]
    sin = mul_sin.input[1] if mul_sin.input[0] == concat.output[0] else mul_sin.input[0]
    cos_node, sin_node = index.made_by(cos, "Cos"), index.made_by(sin, "Sin")
    if cos_node is None or sin_node is None or cos_node.input[0] != sin_node.input[0]:
        return None
    table = _angles_from_positions(index, cos_node.input[0], tables)
    if table is None or 2 * tables[table].size != int(shape[2]):
        return None
    add = index.only_use(mul_cos.output[0], "Add")
    if add is None or set(add.input) != {mul_cos.output[0], mul_sin.output[0]} \
            or index.only_use(mul_sin.output[0], "Add") is not add:
        return None
    flat = index.only_use(add.output[0], "Reshape")
    if flat is None:
        return None
    heads = int(shape[1])
    return _Rope([reshape, split, neg, concat, mul_cos, mul_sin, add, flat], reshape.input[0], flat.output[0], heads,
                 table)


def _replace(field: Any, items: list[Any]) -> None:
    """Make ITEMS the contents of the repeated message FIELD (graph.node, graph.initializer); they are copied
    first, because clearing a repeated field detaches the messages in it."""
    copies = []
    for item in items:
        copy = type(item)()
        copy.CopyFrom(item)
        copies.append(copy)
    del field[:]
    field.extend(copies)


def _remove_dead(graph: onnx.GraphProto) -> int:
    """Drop nodes none of whose outputs is used (repeatedly), then initializers nobody reads; returns how
    many nodes went."""
    removed = 0
    while True:
        nodes = list(graph.node)
        used = {name for node in nodes for name in node.input} | {o.name for o in graph.output}
        live = [n for n in nodes if any(o in used for o in n.output if o)]
        if len(live) == len(nodes):
            break
        removed += len(nodes) - len(live)
        _replace(graph.node, live)
    inputs = {i.name for i in graph.input}
    initializers = list(graph.initializer)
    keep = [t for t in initializers if t.name in used or t.name in inputs]
    if len(keep) != len(initializers):
        _replace(graph.initializer, keep)
    return removed


def fuse_rotary(model: onnx.ModelProto, max_positions: int) -> int:
    """Rewrite MODEL in place; returns the number of rope subgraphs replaced (0: model unchanged)."""
    graph = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer
             if t.data_location != onnx.TensorProto.EXTERNAL and t.name.startswith(("const.", INV_FREQ))}
    tables = {name: array for name, array in inits.items() if _is_table(name) and array.ndim == 1}
    if not tables or max_positions < 1:
        return 0
    nodes = list(graph.node)  # one wrapper per node, alive while this list is: id() below is stable
    index = _Index.of(nodes, graph)
    found = [r for r in (_match(index, n, inits, tables) for n in nodes if n.op_type == "Reshape") if r is not None]
    if not found:
        return 0
    used = sorted({r.table for r in found})
    if sum(2 * max_positions * tables[t].size * 4 for t in used) > MAX_TABLE_BYTES:
        log.info("rope not fused: cos/sin tables for %d positions would take over %d MiB", max_positions,
                 MAX_TABLE_BYTES >> 20)
        return 0
    caches: dict[str, tuple[str, str]] = {}  # table -> (cos cache, sin cache)
    for table in used:
        suffix = table[len(INV_FREQ):]  # "" for rope.inv_freq, ".local" for rope.inv_freq.local
        caches[table] = (f"rope.cos_cache{suffix}", f"rope.sin_cache{suffix}")
        angles = np.arange(max_positions, dtype=np.float32)[:, None] * tables[table].astype(np.float32)[None, :]
        graph.initializer.extend([
            numpy_helper.from_array(np.cos(angles).astype(np.float32), caches[table][0]),
            numpy_helper.from_array(np.sin(angles).astype(np.float32), caches[table][1]),
        ])
    graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "rope.axis1"))
    drop = {id(n) for r in found for n in r.nodes}
    starts = {id(r.nodes[0]): r for r in found}
    first = min(i for i, n in enumerate(nodes) if id(n) in drop)
    new_nodes = [helper.make_node("Unsqueeze", ["position_ids", "rope.axis1"], ["rope.position_ids_2d"],
                                  name="rope.position_ids_2d")]
    kept: list[onnx.NodeProto] = []
    for i, node in enumerate(nodes):
        if i == first:
            kept.extend(new_nodes)
        if id(node) in drop:
            rope = starts.get(id(node))
            if rope is not None:  # emit the fused node where the pattern started
                base = rope.result.replace(":", "_")
                kept += [
                    helper.make_node("Unsqueeze", [rope.source, "rope.axis1"], [f"{base}.rope_in"], name=f"{base}.rope_in"),
                    helper.make_node("RotaryEmbedding", [f"{base}.rope_in", "rope.position_ids_2d", *caches[rope.table]],
                                     [f"{base}.rope_out"], name=f"{base}.rope", domain=MS_DOMAIN,
                                     num_heads=rope.heads, interleaved=0),
                    helper.make_node("Squeeze", [f"{base}.rope_out", "rope.axis1"], [rope.result], name=f"{base}.rope_flat"),
                ]
            continue
        kept.append(node)
    _replace(graph.node, kept)
    removed = _remove_dead(graph)
    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    log.info("fused %d rotary embeddings over %d table(s) (%d unused angle nodes dropped)", len(found), len(used),
             removed)
    return len(found)


def _rope_chain(index: _Index, value: str, heads: int) -> tuple[str, onnx.NodeProto, list[onnx.NodeProto]] | None:
    """VALUE = Squeeze(RotaryEmbedding(Unsqueeze(source))) as fuse_rotary writes it, each link used only here,
    rotating all of each of HEADS heads in rotate-half form: (source, the RotaryEmbedding node, the 3 nodes)."""
    squeeze = index.producer.get(value)
    if squeeze is None or squeeze.op_type != "Squeeze" or value in index.graph_outputs:
        return None
    rope = index.producer.get(squeeze.input[0])
    if rope is None or rope.op_type != "RotaryEmbedding" or rope.domain != MS_DOMAIN or len(rope.input) != 4:
        return None
    unsqueeze = index.producer.get(rope.input[0])
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return None
    if _attr(rope, "interleaved", 0) != 0 or _attr(rope, "num_heads", 0) != heads or \
            _attr(rope, "rotary_embedding_dim", 0) not in (0, None) or _attr(rope, "scale", 1.0) != 1.0:
        return None
    for link in (unsqueeze.output[0], rope.output[0]):
        if len(index.consumers.get(link, [])) != 1 or link in index.graph_outputs:
            return None
    return unsqueeze.input[0], rope, [unsqueeze, rope, squeeze]


def fuse_rotary_into_attention(model: onnx.ModelProto, positions: str = "position_ids") -> int:
    """Rewrite MODEL (after fuse_rotary) in place; returns the number of attention nodes that took their
    rotary embeddings (0: model unchanged)."""
    graph = model.graph
    nodes = list(graph.node)
    index = _Index.of(nodes, graph)
    drop: set[int] = set()
    fused = 0
    for node in nodes:
        if node.op_type != "PagedAttention" or node.domain != "octavo" or len(node.input) != 9:
            continue
        q = _rope_chain(index, node.input[0], int(_attr(node, "num_heads", 0)))
        k = _rope_chain(index, node.input[1], int(_attr(node, "kv_num_heads", 0)))
        if q is None or k is None or list(q[1].input[1:]) != list(k[1].input[1:]):
            continue
        rope_positions = index.producer.get(q[1].input[1])  # Unsqueeze(position_ids) into [T, 1]
        if rope_positions is None or rope_positions.op_type != "Unsqueeze" or rope_positions.input[0] != positions:
            continue
        if len(index.consumers.get(node.input[0], [])) != 1 or len(index.consumers.get(node.input[1], [])) != 1:
            continue
        cos, sin = q[1].input[2], q[1].input[3]
        node.input[0], node.input[1] = q[0], k[0]
        node.input.extend([positions, cos, sin])
        drop.update(id(n) for n in q[2] + k[2])
        fused += 1
    if not fused:
        return 0
    _replace(graph.node, [n for n in nodes if id(n) not in drop])
    _remove_dead(graph)
    log.info("moved the rotary embeddings of %d attention nodes into them", fused)
    return fused


INT8_STEPS = {"prompt": "prompt_int8", "decode": "decode_int8"}  # which steps -> the op's attribute


def _int8_fits(bits: int, block_size: int, steps: str) -> bool:
    """Whether the int8 path can take a layout on STEPS: 4-bit codes in blocks of a multiple of 32; on decode steps
    also 8-bit codes in blocks of 16 or 32 (the op then takes them only if every code is below 64: Q6_K, Q5_x, not
    Q8_0)."""
    if bits == 4:
        return block_size % 32 == 0
    return steps == "decode" and bits == 8 and block_size in (16, 32)


def set_int8_activations(model: onnx.ModelProto, steps: str = "prompt") -> int:
    """Ask every octavo.BlockMatMul node, and every octavo.MoE node with block experts, whose layout the int8 path
    can take (_int8_fits) for it on its STEPS (INT8_STEPS: "prompt", the float32 path's steps, attribute
    prompt_int8 = 1; "decode", the 16-bit path's, decode_int8 = 1; plugins/onnxruntime/block_matmul_int8.cc), in
    place; returns how many. Other nodes (float experts, and 8-bit codes on prompt steps) keep their path, which
    the op would keep anyway."""
    name = INT8_STEPS[steps]
    count = 0
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if (node.domain, node.op_type) == ("octavo", "BlockMatMul"):
            fits = _int8_fits(attrs["bits"].i, attrs["block_size"].i, steps)
        elif (node.domain, node.op_type) == ("octavo", "MoE") and "expert_inter" in attrs:
            fits = any(_int8_fits(attrs[f"{part}_bits"].i, attrs[f"{part}_block_size"].i, steps)
                       for part in ("gate_up", "down"))
        else:
            continue
        if not fits:
            continue
        if name in attrs:
            node.attribute.remove(attrs[name])
        node.attribute.append(helper.make_attribute(name, 1))
        count += 1
    return count
