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
from octavo.runtime.backends.ort_fusions import MAX_TABLE_BYTES, fuse_rotary
from octavo.runtime.step_inputs import one_sequence
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
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
