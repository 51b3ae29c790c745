"""The collectors the ONNX exporter writes through: `Graph` (nodes and initializers; small constants inline, weights
to the data file), `CheckpointTensors` (the checkpoint's tensors, checked against the shapes the spec implies) and
`emit` (one node with a chosen output name). octavo.export.projection and octavo.export.graph build on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from octavo.errors import ModelFormatError
from octavo.export.checkpoint import Checkpoint
from octavo.export.gguf_blocks import Blocks, promote
from octavo.export.weights_file import WeightsFile

OP_DOMAIN = "octavo"  # octavo's ONNX Runtime ops (PagedAttention, BlockMatMul, BlockGather, MoE, Int8Residual, FoldRows)

Part = tuple[str, tuple[int, int]]  # (checkpoint tensor name, its [out, in] shape)


@dataclass(slots=True)
class Graph:
    """Nodes and initializers being collected; small constants inline, weights to the data file."""

    weights: WeightsFile
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[TensorProto] = field(default_factory=list)
    _count: int = 0
    _shared: set[str] = field(default_factory=set)

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, domain: str = "", **attrs: object) -> list[str]:
        self._count += 1
        base = f"{op_type.lower()}_{self._count}"
        outputs = [f"{base}:{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=base, domain=domain, **attrs))
        return outputs

    def op1(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        return self.op(op_type, inputs, **attrs)[0]

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(array, name))
        return name

    def shared_const(self, name: str, array: np.ndarray) -> str:
        """A constant used by many nodes: added once."""
        if self.first_use(name):
            self.const(name, array)
        return name

    def first_use(self, name: str) -> bool:
        """True the first time NAME is asked for: a node or constant that many nodes share is added once."""
        if name in self._shared:
            return False
        self._shared.add(name)
        return True

    def weight(self, name: str, parts: list[np.ndarray], dtype: str = "<f4") -> str:
        self.initializers.append(self.weights.add(name, parts, dtype))
        return name

    def weight_once(self, name: str, parts: list[np.ndarray], dtype: str = "<f4") -> str:
        """A weight that two nodes may ask for with the same contents (a tied embedding's blocks, gathered and
        multiplied): written the first time only."""
        if self.first_use("weight:" + name):
            self.weight(name, parts, dtype)
        return name


@dataclass(slots=True)
class CheckpointTensors:
    """Fetches checkpoint tensors and checks their shapes against the spec."""

    checkpoint: Checkpoint

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self.checkpoint.tensor(name)
        if tuple(array.shape) != shape:
            raise ModelFormatError(
                f"{self.checkpoint.source}: tensor {name!r} has shape {tuple(array.shape)}, the config implies {shape}"
            )
        return array

    def blocks(self, parts: list[Part]) -> Blocks | None:
        """The PARTS' own quantized blocks stacked along N in one layout (gguf_blocks.promote), or None
        when any part has none (a float or unmapped type: the caller keeps the projection float)."""
        found = self.part_blocks(parts)
        return None if found is None else promote(found)

    def part_blocks(self, parts: list[Part]) -> list[Blocks] | None:
        """Each of PARTS' own quantized blocks, or None when any part has none."""
        found = []
        for name, shape in parts:
            b = self.checkpoint.blocks(name)
            if b is None:
                return None
            if (b.n, b.k) != shape:
                raise ModelFormatError(f"{self.checkpoint.source}: tensor {name!r} has shape {(b.n, b.k)}, "
                                       f"the config implies {shape}")
            found.append(b)
        return found

    def bias(self, name: str, size: int) -> np.ndarray | None:
        return self.get(name, (size,)) if name in self.checkpoint.tensor_names else None


def emit(g: Graph, op_type: str, inputs: list[str], output: str | None, domain: str = "", **attrs: object) -> str:
    """One node; its output named OUTPUT, or a fresh name when None."""
    if output is None:
        return g.op1(op_type, inputs, domain=domain, **attrs)
    g.nodes.append(helper.make_node(op_type, inputs, [output], name=output, domain=domain, **attrs))
    return output
