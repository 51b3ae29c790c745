"""The onnxruntime backend's KV pools in another dtype than the export's: which numpy dtype a pool holds,
its shape, and how an exported graph is switched to float16 or int8 pools in memory (no re-export). Which
dtype the engine asks for: kv_dtype.py. int8 pools are [num_blocks, block_size, kv_heads, head_dim + 2]:
each head row's codes, then its float16 scale as two bytes (plugins/onnxruntime/kv_int8.h).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from octavo.errors import InvalidRequestError
from octavo.export.manifest import KV_INT8_SCALE_BYTES

if TYPE_CHECKING:
    from onnx import ModelProto

NUMPY_KV_DTYPE: dict[str, type[np.generic]] = {"float32": np.float32, "float16": np.float16, "int8": np.int8}
PAGED_ATTENTION = ("octavo", "PagedAttention")  # (domain, op_type) of the node whose pools are switched


def pool_dtype(dtype: str) -> type[np.generic]:
    """The numpy element type of an onnxruntime pool of DTYPE (a resolved kv cache dtype)."""
    if dtype not in NUMPY_KV_DTYPE:
        raise InvalidRequestError(f"the onnxruntime backend keeps KV pools in float32, float16 or int8, not {dtype!r}")
    return NUMPY_KV_DTYPE[dtype]


def pool_shape(dtype: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one layer's key (or value) pool of DTYPE: an int8 pool's rows end in their scale."""
    return (num_blocks, block_size, kv_heads, head_dim + (KV_INT8_SCALE_BYTES if dtype == "int8" else 0))


def set_cache_dtype(model: ModelProto, dtype: str) -> int:
    """Declare every octavo.PagedAttention pool (its key_cache/value_cache inputs and their aliased
    outputs, wherever the graph names their type: inputs, outputs, value_info) as DTYPE, in place.
    Returns how many tensor declarations changed; the op accepts float32, float16 and int8 pools (an int8
    pool's declared last dimension, where the graph fixes it, grows by the scale's bytes)."""
    from onnx import helper

    elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(pool_dtype(dtype)))
    graph = model.graph
    pool_names: set[str] = set()
    for node in graph.node:
        if (node.domain, node.op_type) == PAGED_ATTENTION:
            pool_names.update(node.input[3:5])
            pool_names.update(node.output[1:3])
    pool_names.discard("")
    changed = 0
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.name in pool_names and info.type.tensor_type.elem_type != elem_type:
            info.type.tensor_type.elem_type = elem_type
            dims = info.type.tensor_type.shape.dim
            if dtype == "int8" and len(dims) == 4 and dims[3].HasField("dim_value"):
                dims[3].dim_value += KV_INT8_SCALE_BYTES
            changed += 1
    return changed


def expose_pool_outputs(model: ModelProto) -> dict[str, str]:
    """Make every octavo.PagedAttention pool output a graph output, in place; returns {pool output: the
    pool input it aliases}. The caller must bind each to its pool input's own OrtValue (then the op
    writes the caller's buffer and nothing is copied).

    Why: ONNX Runtime's InsertCastTransformer forces an "isolated" float16 node on the CPU EP to run its
    float32 kernel between inserted Casts when none of its float16 inputs comes from another node and none
    of its float16 outputs is consumed — exactly a PagedAttention node over float16 graph-input pools with
    dangling pool outputs. The op would then write a temporary float32 copy and the pools would never
    change. A node that produces a graph output is exempt, so the pool outputs become graph outputs."""
    from onnx import helper

    graph = model.graph
    declared = {info.name: info for info in [*graph.input, *graph.value_info]}
    existing = {info.name for info in graph.output}
    aliases: dict[str, str] = {}
    for node in graph.node:
        if (node.domain, node.op_type) != PAGED_ATTENTION:
            continue
        for pool_input, pool_output in zip(node.input[3:5], node.output[1:3]):
            if not pool_output:
                continue
            aliases[pool_output] = pool_input
            if pool_output not in existing:
                elem_type = declared[pool_input].type.tensor_type.elem_type if pool_input in declared else 0
                graph.output.append(helper.make_tensor_value_info(pool_output, elem_type, None))
                existing.add(pool_output)
    return aliases
