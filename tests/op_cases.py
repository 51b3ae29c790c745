"""Random paged-attention steps and one-node ONNX models (and sessions) for the op tests and the op benchmark."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper

if TYPE_CHECKING:
    import onnxruntime as ort

INPUTS = (
    ("query", TensorProto.FLOAT), ("key", TensorProto.FLOAT), ("value", TensorProto.FLOAT),
    ("key_cache", TensorProto.FLOAT), ("value_cache", TensorProto.FLOAT),
    ("cumulative_sequence_length", TensorProto.INT32), ("past_seqlens", TensorProto.INT32),
    ("block_table", TensorProto.INT32), ("slot_mapping", TensorProto.INT64),
)
OUTPUTS = ("output", "key_cache_out", "value_cache_out")


def paged_attention_model(
    *, num_heads: int, kv_num_heads: int, scale: float, sliding_window: int = 0, softcap: float = 0.0,
    cache_outputs: bool = True, prompt_bf16: int = 0,
) -> ModelProto:
    """One octavo.PagedAttention node. cache_outputs=False leaves the pool outputs dangling, as in the
    exported models (only `output` is a graph output). prompt_bf16=1: the attribute of a block-bf16 export
    (absent otherwise, as in every other export)."""
    inputs = [helper.make_tensor_value_info(name, dtype, None) for name, dtype in INPUTS]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
               for name in (OUTPUTS if cache_outputs else OUTPUTS[:1])]
    node = helper.make_node(
        "PagedAttention", [name for name, _ in INPUTS], list(OUTPUTS), domain="octavo",
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, sliding_window=sliding_window,
        softcap=softcap, **({"prompt_bf16": prompt_bf16} if prompt_bf16 else {}),
    )
    graph = helper.make_graph([node], "paged_attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("octavo", 1)],
                             ir_version=9)


@dataclass(slots=True)
class Step:
    """Inputs of one step; pools hold random garbage wherever no token was written."""
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    cumulative_sequence_length: np.ndarray
    past_seqlens: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray

    def feeds(self) -> dict[str, np.ndarray]:
        """Fresh copies of every input (ORT may use feed buffers in place)."""
        return {name: getattr(self, name).copy() for name, _ in INPUTS}


def random_step(
    rng: np.random.Generator, seqs: list[tuple[int, int]], *, num_heads: int, kv_num_heads: int, head_dim: int,
    block_size: int, spare_blocks: int = 3,
) -> Step:
    """seqs: (past, new) per sequence. Blocks are handed out in shuffled order (non-contiguous tables)."""
    blocks_per_seq = [-(-(past + new) // block_size) for past, new in seqs]
    max_blocks = max(max(blocks_per_seq), 1) + 1  # a spare, unused column
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = rng.permutation(num_blocks)
    block_table = np.full((len(seqs), max_blocks), -1, dtype=np.int32)
    used = 0
    for b, count in enumerate(blocks_per_seq):
        block_table[b, :count] = physical[used:used + count]
        used += count
    # unused columns stay -1: neither the op nor the reference may look at them

    num_tokens = sum(new for _, new in seqs)
    slots = []
    for b, (past, new) in enumerate(seqs):
        positions = np.arange(past, past + new)
        slots.extend(block_table[b, positions // block_size].astype(np.int64) * block_size + positions % block_size)
    cu = np.concatenate([[0], np.cumsum([new for _, new in seqs])]).astype(np.int32)
    pool_shape = (num_blocks, block_size, kv_num_heads, head_dim)
    f32 = np.float32
    return Step(
        query=rng.standard_normal((num_tokens, num_heads * head_dim)).astype(f32),
        key=rng.standard_normal((num_tokens, kv_num_heads * head_dim)).astype(f32),
        value=rng.standard_normal((num_tokens, kv_num_heads * head_dim)).astype(f32),
        key_cache=rng.standard_normal(pool_shape).astype(f32),
        value_cache=rng.standard_normal(pool_shape).astype(f32),
        cumulative_sequence_length=cu,
        past_seqlens=np.array([past for past, _ in seqs], dtype=np.int32),
        block_table=block_table,
        slot_mapping=np.array(slots, dtype=np.int64).reshape(num_tokens),
    )


def random_case(rng: np.random.Generator, head_dims: list[int], block_sizes: list[int],
                max_past: int) -> tuple[list[tuple[int, int]], dict, int, int, Step]:
    """A random configuration (GQA group, head_dim, block size, 1-5 sequences with up to MAX_PAST cached and
    up to 40 new tokens, window, softcap, scale) and its step: (seqs, op attributes, head_dim, block_size, step)."""
    kv_heads = int(rng.choice([1, 2, 3, 4]))
    group = int(rng.choice([1, 2, 4, 8]))
    head_dim = int(rng.choice(head_dims))
    block_size = int(rng.choice(block_sizes))
    seqs = [(int(rng.integers(0, max_past)), int(rng.integers(0, 40))) for _ in range(int(rng.integers(1, 6)))]
    seqs[0] = (seqs[0][0], max(seqs[0][1], 1))
    window = int(rng.choice([0, 0, 1, 9, 500]))
    cap = float(rng.choice([0.0, 0.0, 2.5]))
    attrs = dict(num_heads=kv_heads * group, kv_num_heads=kv_heads, scale=float(rng.uniform(0.05, 0.3)),
                 sliding_window=window, softcap=cap)
    step = random_step(rng, seqs, num_heads=kv_heads * group, kv_num_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size)
    return seqs, attrs, head_dim, block_size, step


def one_node_session(node: NodeProto, inputs: list[tuple[str, int]], outputs: list[str],
                     initializers: list[TensorProto], threads: int = 2) -> "ort.InferenceSession":
    """An ONNX Runtime session of NODE alone (octavo's op library registered): INPUTS (name, element type) are
    the graph's inputs, OUTPUTS its float outputs, INITIALIZERS its constants."""
    import onnxruntime as ort

    from octavo.runtime.backends.oplib import library_path

    graph = helper.make_graph([node], "one_node", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("octavo", 1)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library_path()))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
