"""Rewrite an exported model.onnx so TensorRT's ONNX parser maps every octavo.PagedAttention node to the
`octavo::PagedAttention` plugin (octavo/tensorrt/plugin.py). Pure `onnx`; no TensorRT.

What the parser needs (TensorRT's quickly-deployable-plugin sample and onnx-tensorrt's fallback plugin
importer; see docs/tensorrt.md):
* op_type equal to the plugin name ("PagedAttention") and a STRING attribute `plugin_namespace`
  ("octavo"); `plugin_version` (string, default "1") is written explicitly. The node goes to the default
  domain "" like the sample's node (the exporter's custom domain "octavo" is dropped here, not in the
  exporter).
* an INT attribute `aot` = 1: the parser then asks the plugin creator for the ahead-of-time
  implementation (QuickPluginCreationRequest STRICT_AOT) instead of leaving the choice to it.
* every plugin attribute present (the parser only forwards attributes the node has), re-emitted in the
  plugin's registration order.
* static block size and head_dim on the pool inputs: they are compiled into the kernel.
* the node's pool outputs (aliased to its pool inputs by the plugin) as GRAPH outputs
  `key_cache.{l}.out` / `value_cache.{l}.out`: TensorRT honours `getAliasedInput` only for a network
  output (with PreviewFeature.ALIASED_PLUGIN_IO_10_03 on, set by the builder), and the runtime binds
  each such output to the same device address as its input pool, so the kernel's writes land in the
  caller's pool.

Precision is part of the graph (TensorRT 11 networks are always strongly typed). `kv_dtype`
float16/bfloat16: pool inputs/outputs get that type, Casts go around each attention node (q/k/v in,
output back to float32), and the projection and embedding weights are converted to that type with
Casts around their Gemm/Gather (`octavo.tensorrt.half_weights`); norms, residuals and logits stay float32.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from octavo.errors import ModelFormatError
from octavo.export.moe_spec import moe_not_on_tensorrt
from octavo.export.quant_options import TENSORRT_FP32_HOWTO, not_on_tensorrt
from octavo.tensorrt.engine_info import pool_output_name
from octavo.tensorrt.half_weights import convert_weights_to_half

PLUGIN_NAMESPACE = "octavo"
PLUGIN_VERSION = "1"
OP_TYPE = "PagedAttention"
# registration order of the plugin's attributes, with the value used when the exporter left one out
ATTRIBUTE_DEFAULTS: dict[str, int | float | None] = {
    "num_heads": None, "kv_num_heads": None, "scale": None, "sliding_window": 0, "softcap": 0.0,
}
KV_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
POOL_PREFIXES = ("key_cache.", "value_cache.")
# ONNX Runtime's contrib ops (MatMulNBits of --weights int8|int4 and --quant-kernel matmulnbits): no TensorRT importer
UNSUPPORTED_DOMAINS = {"com.microsoft": not_on_tensorrt("quantized exports (--weights int8|int4, --quant-kernel "
                                                        "matmulnbits)", ["MatMulNBits"])}
EXPORT_DOMAIN = "octavo"  # the exporter's custom-op domain: PagedAttention has a plugin, its other ops do not
UNSUPPORTED_OPS = {"BlockMatMul": not_on_tensorrt("quantized weights (a GGUF's own blocks, the default for a quantized "
                                                  ".gguf, or --weights int8|int4)", ["BlockMatMul"]),
                   "BlockGather": not_on_tensorrt("a GGUF's token embedding in the file's own blocks (a quantized .gguf's "
                                                  "default)", ["octavo.BlockGather"]),
                   "MoE": moe_not_on_tensorrt("the export")}


def _attribute_value(node: onnx.NodeProto, name: str) -> int | float | None:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return None


def _rewrite_node(node: onnx.NodeProto) -> None:
    values = {}
    for name, default in ATTRIBUTE_DEFAULTS.items():
        value = _attribute_value(node, name)
        if value is None:
            if default is None:
                raise ModelFormatError(f"PagedAttention node {node.name!r} lacks the required attribute {name!r}")
            value = default
        values[name] = value
    del node.attribute[:]
    node.attribute.extend([
        helper.make_attribute("num_heads", int(values["num_heads"])),
        helper.make_attribute("kv_num_heads", int(values["kv_num_heads"])),
        helper.make_attribute("scale", float(values["scale"])),
        helper.make_attribute("sliding_window", int(values["sliding_window"])),
        helper.make_attribute("softcap", float(values["softcap"])),
        helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
        helper.make_attribute("plugin_version", PLUGIN_VERSION),
        helper.make_attribute("aot", 1),  # onnx has no bool attribute; the parser reads it as an int
    ])
    node.domain = ""


def _fix_pool_inputs(graph: onnx.GraphProto, block_size: int, elem_type: int) -> int:
    count = 0
    for value_info in graph.input:
        if not value_info.name.startswith(POOL_PREFIXES):
            continue
        tensor_type = value_info.type.tensor_type
        dims = tensor_type.shape.dim
        if len(dims) != 4:
            raise ModelFormatError(f"pool input {value_info.name} has rank {len(dims)}, expected 4")
        dims[1].ClearField("dim_param")
        dims[1].dim_value = block_size
        tensor_type.elem_type = elem_type
        count += 1
    return count


def _expose_pool_outputs(graph: onnx.GraphProto, attention: list[onnx.NodeProto]) -> None:
    """Name each node's pool outputs after its pool inputs and make them graph outputs of the same type."""
    inputs = {value_info.name: value_info for value_info in graph.input}
    for node in attention:
        if len(node.output) != 3:
            raise ModelFormatError(f"PagedAttention node {node.name!r} has {len(node.output)} outputs; expected "
                                   "3 (output, key_cache, value_cache)")
        for slot, pool_slot in ((1, 3), (2, 4)):
            pool = node.input[pool_slot]
            if pool not in inputs:
                raise ModelFormatError(f"PagedAttention node {node.name!r} reads pool {pool!r}, which is not a graph input")
            _rename_value(graph, node.output[slot], pool_output_name(pool))
            out = onnx.ValueInfoProto()
            out.CopyFrom(inputs[pool])
            out.name = pool_output_name(pool)
            graph.output.append(out)


def _rename_value(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new


def _cast_around_attention(graph: onnx.GraphProto, elem_type: int) -> None:
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != OP_TYPE:
            nodes.append(node)
            continue
        for i in range(3):  # query, key, value
            cast_out = f"{node.input[i]}.kv_cast"
            nodes.append(helper.make_node("Cast", [node.input[i]], [cast_out], name=f"{node.name}.cast_in{i}", to=elem_type))
            node.input[i] = cast_out
        original = node.output[0]
        node.output[0] = f"{original}.kv_dtype"
        nodes.append(node)
        nodes.append(helper.make_node("Cast", [node.output[0]], [original], name=f"{node.name}.cast_out", to=TensorProto.FLOAT))
    del graph.node[:]
    graph.node.extend(nodes)


def prepare_onnx_for_tensorrt(
    model_path: str | Path, out_path: str | Path, *, block_size: int = 16, kv_dtype: str = "float32",
) -> Path:
    """Write OUT_PATH: MODEL_PATH with its PagedAttention nodes mapped to the TensorRT plugin.

    The external weights file is referenced, not copied: OUT_PATH in the model's folder shares it; in
    another folder it is copied (onnx refuses symlinked or hard-linked data files). Returns OUT_PATH.
    """
    model_path, out_path = Path(model_path), Path(out_path)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    model = _load_graph(model_path)
    graph = model.graph
    _refuse_unsupported(model_path, graph)
    attention = [n for n in graph.node if n.op_type == OP_TYPE]
    if not attention:
        raise ModelFormatError(f"{model_path} has no {OP_TYPE} node; is it an octavo export?")
    for node in attention:
        _rewrite_node(node)
    elem_type = KV_DTYPES[kv_dtype]
    if _fix_pool_inputs(graph, block_size, elem_type) != 2 * len(attention):
        raise ModelFormatError(f"{model_path}: expected one key and one value pool input per attention node")
    _expose_pool_outputs(graph, attention)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if elem_type != TensorProto.FLOAT:
        _cast_around_attention(graph, elem_type)
        convert_weights_to_half(model, model_path.parent, out_path, kv_dtype)
    _link_external_data(model, model_path.parent, out_path.parent)
    onnx.save(model, str(out_path))
    return out_path


def _load_graph(model_path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError / OSError variants
        raise ModelFormatError(f"cannot read {model_path}: {exc}") from exc


def _refuse_unsupported(model_path: Path, graph: onnx.GraphProto) -> None:
    """A node TensorRT's parser has no importer or plugin for is a ModelFormatError naming it and the way out,
    before anything is rewritten. The first node of every such op is named (an int8/int4 export on the block kernel
    runs octavo.BlockMatMul and, for layers whose K is not a multiple of the block, MatMulNBits: both are said)."""
    refused: dict[tuple[str, str], str] = {}
    for node in graph.node:
        if (node.domain, node.op_type) in refused:
            continue
        if node.domain in UNSUPPORTED_DOMAINS:
            why = UNSUPPORTED_DOMAINS[node.domain]
        elif node.domain == EXPORT_DOMAIN and node.op_type != OP_TYPE:
            why = UNSUPPORTED_OPS.get(node.op_type, f"{EXPORT_DOMAIN}.{node.op_type} is an ONNX Runtime custom op "
                                                    f"with no TensorRT plugin; {TENSORRT_FP32_HOWTO}")
        else:
            continue
        refused[(node.domain, node.op_type)] = f"node {node.name!r} ({node.domain}.{node.op_type}): {why}"
    if refused:
        raise ModelFormatError(f"{model_path}: " + "; ".join(refused.values()))


def _link_external_data(model: onnx.ModelProto, src_dir: Path, dst_dir: Path) -> None:
    if src_dir.resolve() == dst_dir.resolve():
        return
    locations = {
        entry.value
        for tensor in model.graph.initializer if tensor.data_location == TensorProto.EXTERNAL
        for entry in tensor.external_data if entry.key == "location"
    }
    dst_dir.mkdir(parents=True, exist_ok=True)
    for location in locations:
        target = dst_dir / location
        if not target.exists():  # onnx refuses symlinked and hard-linked data files ("link attack")
            shutil.copyfile(src_dir / location, target)
