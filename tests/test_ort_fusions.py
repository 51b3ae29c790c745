"""The ONNX Runtime backend's in-memory graph rewrites (octavo.runtime.backends.ort_fusions) against the
graph as exported: same logits, fewer nodes; anything that does not match is left alone."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from octavo.export.manifest import Manifest
from octavo.runtime.backends.oplib import library_path
from octavo.runtime.backends.ort_fusions import MAX_TABLE_BYTES, fuse_rotary, fuse_rotary_into_attention
from step_inputs import one_sequence
from tests.engine_helpers import exported


def _session(model: onnx.ModelProto, folder: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library_path()))
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(manifest: Manifest, tokens: list[int], start: int, block_size: int = 16) -> dict[str, np.ndarray]:
    blocks = -(-(start + len(tokens)) // block_size)
    step = one_sequence(tokens, start, np.arange(blocks, dtype=np.int32), block_size, all_logits=True)
    feeds = {name: getattr(step, name) for name in ("input_ids", "position_ids", "cumulative_sequence_length",
                                                   "past_seqlens", "block_table", "slot_mapping", "logits_indices")}
    shape = (blocks, block_size, manifest.num_kv_heads, manifest.head_dim)
    rng = np.random.default_rng(0)  # a cache holding earlier tokens' K/V (random: the same for both graphs)
    for layer in range(manifest.num_layers):
        feeds[f"key_cache.{layer}"] = rng.standard_normal(shape, np.float32)
        feeds[f"value_cache.{layer}"] = rng.standard_normal(shape, np.float32)
    return feeds


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "gemma2"])
def test_fused_rope_gives_the_exported_graphs_logits_with_fewer_nodes(hf_model_dir, arch: str) -> None:
    folder = exported(hf_model_dir(arch))
    manifest = Manifest.load(folder)
    plain = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    fused = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    assert fuse_rotary(fused, manifest.max_context) == 2 * manifest.num_layers  # q and k of every layer
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("RotaryEmbedding") == 2 * manifest.num_layers
    assert not {"Neg", "Cos", "Sin", "Concat"} & set(ops)  # the rope and angle nodes are gone
    assert len(fused.graph.node) < len(plain.graph.node) - 8 * manifest.num_layers
    for tokens, start in (([5, 9, 2, 7, 11, 3, 8], 0), ([4, 6, 1], 37), ([12], manifest.max_context - 1)):
        feeds = _feeds(manifest, tokens, start)
        want = _session(plain, folder).run(["logits"], {k: v.copy() for k, v in feeds.items()})[0]
        got = _session(fused, folder).run(["logits"], {k: v.copy() for k, v in feeds.items()})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _logits(model: onnx.ModelProto, folder: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return _session(model, folder).run(["logits"], {k: v.copy() for k, v in feeds.items()})[0]


def test_each_rope_is_fused_with_the_table_its_angles_come_from(hf_model_dir) -> None:
    """Gemma 3: sliding layers rotate with rope.inv_freq.local (theta 500), global ones with rope.inv_freq
    (theta 10000, linear 8): each fused node reads its own table's caches, and the logits stay the same."""
    folder = exported(hf_model_dir("gemma3"))
    manifest = Manifest.load(folder)
    spec_local = [0, 2]  # tests/models.py: sliding, full, sliding
    plain = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    fused = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    assert fuse_rotary(fused, manifest.max_context) == 2 * manifest.num_layers
    ropes = [n for n in fused.graph.node if n.op_type == "RotaryEmbedding"]
    tables = [tuple(n.input[2:]) for n in ropes]
    local = ("rope.cos_cache.local", "rope.sin_cache.local")
    assert tables.count(local) == 2 * len(spec_local)
    assert tables.count(("rope.cos_cache", "rope.sin_cache")) == 2 * (manifest.num_layers - len(spec_local))
    assert [t == local for t in tables] == [True, True, False, False, True, True]  # q, k of layers 0, 1, 2
    feeds = _feeds(manifest, list(range(3, 40)), 5)
    np.testing.assert_allclose(_logits(fused, folder, feeds), _logits(plain, folder, feeds), rtol=1e-4, atol=1e-4)


def test_a_table_with_another_name_is_left_alone(hf_model_dir) -> None:
    """Only rope.inv_freq and rope.inv_freq.<suffix> are tables: ropes reading anything else stay unfused."""
    folder = exported(hf_model_dir("gemma3"))
    manifest = Manifest.load(folder)
    model = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.name == "rope.inv_freq.local":
            tensor.name = "rope.inv_freqlocal"
    for node in model.graph.node:
        node.input[:] = ["rope.inv_freqlocal" if i == "rope.inv_freq.local" else i for i in node.input]
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    assert fuse_rotary(model, manifest.max_context) == 2  # layer 1 (global) only
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("RotaryEmbedding") == 2 and ops.count("Neg") == 4
    feeds = _feeds(manifest, [7, 1, 9, 4], 11)
    np.testing.assert_allclose(_logits(model, folder, feeds), _logits(plain, folder, feeds), rtol=1e-4, atol=1e-4)


def test_a_graph_that_does_not_match_is_left_unchanged(hf_model_dir) -> None:
    folder = exported(hf_model_dir("llama"))
    manifest = Manifest.load(folder)
    model = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    for node in model.graph.node:  # rotate the other way: no longer HF's rotate_half
        if node.op_type == "Concat" and any(i.startswith("neg") for i in node.input):
            node.input[0], node.input[1] = node.input[1], node.input[0]
    before = model.SerializeToString()
    assert fuse_rotary(model, manifest.max_context) == 0
    assert model.SerializeToString() == before


def test_tables_too_large_are_not_built(hf_model_dir) -> None:
    folder = exported(hf_model_dir("llama"))
    manifest = Manifest.load(folder)
    model = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    before = model.SerializeToString()
    too_many = MAX_TABLE_BYTES // (manifest.head_dim * 4) + 1
    assert fuse_rotary(model, too_many) == 0
    assert model.SerializeToString() == before


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_rotary_moves_into_attention_with_the_same_logits(hf_model_dir, arch: str) -> None:
    """After fuse_rotary, each layer's two RotaryEmbedding chains (Unsqueeze, RotaryEmbedding, Squeeze) become the
    PagedAttention node's position_ids / cos_cache / sin_cache inputs, with its own table (Gemma 3: local and
    global), and the logits stay the exported graph's."""
    folder = exported(hf_model_dir(arch))
    manifest = Manifest.load(folder)
    plain = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    fused = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    assert fuse_rotary(fused, manifest.max_context) == 2 * manifest.num_layers
    before = len(fused.graph.node)
    ropes = [tuple(n.input[2:]) for n in fused.graph.node if n.op_type == "RotaryEmbedding"][::2]  # q's, per layer
    assert fuse_rotary_into_attention(fused) == manifest.num_layers
    ops = [n.op_type for n in fused.graph.node]
    assert "RotaryEmbedding" not in ops and len(fused.graph.node) == before - 6 * manifest.num_layers - 1
    attention = [n for n in fused.graph.node if n.op_type == "PagedAttention"]
    assert [tuple(n.input[9:]) for n in attention] == [("position_ids", *r) for r in ropes]
    for tokens, start in (([5, 9, 2, 7, 11, 3, 8], 0), ([4, 6, 1], 37), ([12], manifest.max_context - 1)):
        feeds = _feeds(manifest, tokens, start)
        np.testing.assert_allclose(_logits(fused, folder, feeds), _logits(plain, folder, feeds), rtol=1e-4, atol=1e-4)


def test_rotary_stays_where_its_result_is_read_elsewhere(hf_model_dir) -> None:
    """A rotated q that something besides the attention node reads (here: a graph output) keeps its nodes; the
    other layers' move."""
    folder = exported(hf_model_dir("llama"))
    manifest = Manifest.load(folder)
    model = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    fuse_rotary(model, manifest.max_context)
    first = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    model.graph.output.append(onnx.helper.make_tensor_value_info(first.input[0], onnx.TensorProto.FLOAT, None))
    query = first.input[0]
    assert fuse_rotary_into_attention(model) == manifest.num_layers - 1
    assert [n.op_type for n in model.graph.node].count("RotaryEmbedding") == 2
    attention = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert attention[0].input[0] == query and len(attention[0].input) == 9
    assert all(len(n.input) == 12 for n in attention[1:])
