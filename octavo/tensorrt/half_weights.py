"""Put float16 / bfloat16 types into an ONNX graph for a strongly typed TensorRT network.

TensorRT 11 builds every network strongly typed (`BuilderFlag.FP16` / `BF16` are gone; the 11.4 Python
bindings have neither): a tensor's precision is the type the ONNX gives it, nothing else. So "build in
fp16" has to be written into the graph. This module does the usual mixed-precision split:

* the weights of every projection (`Gemm` B and its bias C) and of the embedding `Gather` become
  float16/bfloat16 initializers (half the bytes to stream, tensor-core GEMMs);
* a `Cast` to that dtype goes in front of each such Gemm's activation input and a `Cast` back to float32
  after its output (and after the Gather), so norms, softmax-free elementwise work, residual adds and
  the logits stay float32, as in every mixed-precision recipe. TensorRT fuses the casts into the GEMMs.

Only an initializer whose EVERY consumer is one of those slots is converted (a weight also read by,
say, a Mul stays float32). Converted weights are streamed one at a time into a new external data file
next to the output model; the others keep pointing at the export's data file.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from octavo.errors import ModelFormatError

log = logging.getLogger(__name__)

HALF_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
FLOAT16_MAX = 65504.0
# (op_type, input slot) pairs whose float32 initializer may be retyped
_CONVERTIBLE_SLOTS = {("Gemm", 1), ("Gemm", 2), ("Gather", 0)}


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (what torch's .to(bfloat16) does)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def half_bytes(values: np.ndarray, dtype: str, name: str) -> bytes:
    """Little-endian bytes of VALUES in DTYPE; float16 overflow is an error, not a silent inf."""
    if dtype == "float16":
        peak = float(np.abs(values).max()) if values.size else 0.0
        if peak > FLOAT16_MAX:
            raise ModelFormatError(f"weight {name} has |value| {peak:g} > {FLOAT16_MAX:g}, which float16 cannot hold; "
                                   "build with --dtype bf16 (same range as float32) or fp32")
        return values.astype("<f2").tobytes()
    return bfloat16_bits(values).astype("<u2").tobytes()


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _read_float32(tensor: onnx.TensorProto, model_dir: Path) -> np.ndarray:
    """The values of a float32 initializer, inline or external (only this tensor is read)."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return onnx.numpy_helper.to_array(tensor).astype(np.float32, copy=False)
    info = _external_info(tensor)
    count = int(np.prod(tensor.dims, dtype=np.int64))
    offset = int(info.get("offset", 0))
    return np.fromfile(model_dir / info["location"], dtype="<f4", count=count, offset=offset).reshape(tuple(tensor.dims))


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name:
                uses.setdefault(name, []).append((node, slot))
    return uses


def convert_weights_to_half(model: onnx.ModelProto, model_dir: Path, out_path: Path, dtype: str) -> int:
    """Retype the projection / embedding weights of MODEL to DTYPE and insert the Casts around their
    consumers (in place). Converted tensors go to `<out_path>.data` (MODEL_DIR holds the source data).
    Returns the number of converted initializers."""
    elem = HALF_TYPES[dtype]
    graph = model.graph
    uses = _consumers(graph)
    graph_outputs = {o.name for o in graph.output}
    targets = [
        init for init in graph.initializer
        if init.data_type == TensorProto.FLOAT and init.name not in graph_outputs and uses.get(init.name)
        and all((node.op_type, slot) in _CONVERTIBLE_SLOTS for node, slot in uses[init.name])
    ]
    if not targets:
        return 0
    data_name = f"{out_path.name}.data"
    data_path = out_path.parent / data_name
    converted: set[str] = set()
    with open(data_path, "wb") as sink:
        for init in targets:
            payload = half_bytes(_read_float32(init, model_dir), dtype, init.name)
            offset = sink.tell()
            sink.write(payload)
            sink.write(b"\0" * (-len(payload) % 64))  # keep every tensor 64-byte aligned for mmap readers
            name, dims = init.name, list(init.dims)
            init.Clear()  # drops the float32 payload and the old external-data entries
            init.name, init.data_type = name, elem
            init.dims.extend(dims)
            init.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(payload)))):
                init.external_data.add(key=key, value=value)
            converted.add(name)
    _retype_consumers(graph, converted, elem)
    log.info("converted %d weight tensors to %s into %s", len(converted), dtype, data_path)
    return len(converted)


def _retype_consumers(graph: onnx.GraphProto, converted: set[str], elem: int) -> None:
    """Casts around every Gemm / Gather that now reads a half-precision weight."""
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        touched = [i for i, name in enumerate(node.input) if name in converted]
        if not touched:
            nodes.append(node)
            continue
        if node.op_type == "Gemm":
            for slot, name in enumerate(node.input):  # the activation (and any non-converted bias) to half
                if name and name not in converted:
                    cast = f"{name}.to_half.{node.name}"
                    nodes.append(helper.make_node("Cast", [name], [cast], name=f"{node.name}.cast_in{slot}", to=elem))
                    node.input[slot] = cast
        original = node.output[0]
        node.output[0] = f"{original}.half"
        nodes.append(node)
        nodes.append(helper.make_node("Cast", [node.output[0]], [original], name=f"{node.name}.cast_out",
                                      to=TensorProto.FLOAT))
    del graph.node[:]
    graph.node.extend(nodes)
