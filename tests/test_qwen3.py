"""Qwen3 (dense, `Qwen3ForCausalLM`): what is specific to it, against transformers as the reference.

Per-head RMSNorm of q and k (q_norm / k_norm over head_dim, before RoPE), an explicit head_dim that is not
hidden/heads, optional sliding window on some layers (use_sliding_window, max_window_layers, layer_types),
tied embeddings, qkv(+o) biases when attention_bias; GGUF files (llama.cpp arch "qwen3") through octavo's
writer and reader (Qwen3-MoE: tests/test_moe.py, tests/test_moe_gguf.py). The test models randomize
their norm weights (tests/models.py), so a dropped or swapped q/k norm changes the logits.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_helpers import exported, hf_prompt_logits, hf_reference, llm_greedy, prefill_logits
from models import make_random_model

from octavo.errors import ModelFormatError
from octavo.export import export_model
from octavo.export.checkpoint import spec_from_config
from octavo.export.gguf_reader import read_gguf
from octavo.export.gguf_writer import write_gguf
from octavo.export.manifest import Manifest

ATOL = 1e-4
PROMPT_LEN = 40  # longer than the test models' window of 8


def _prompt(vocab_size: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, PROMPT_LEN).tolist()


def _attention_nodes(folder: Path) -> list[onnx.NodeProto]:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return [n for n in model.graph.node if n.op_type == "PagedAttention"]


def _attr(node: onnx.NodeProto, name: str) -> object:
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


# ----------------------------------------------------------------------------- config and graph shape
def test_explicit_head_dim_and_qk_norm_in_manifest_and_graph(hf_model_dir) -> None:  # noqa: ANN001
    src = hf_model_dir("qwen3")
    config = json.loads((src / "config.json").read_text())
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]  # 24 * 4 != 64
    folder = exported(src)
    manifest = Manifest.load(folder)
    assert (manifest.architecture, manifest.head_dim, manifest.num_heads, manifest.num_kv_heads) == ("qwen3", 24, 4, 2)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    consumers = {name: [n for n in model.graph.node if name in n.input] for name in inits}
    for layer in range(manifest.num_layers):
        for which in ("q_norm", "k_norm"):
            name = f"model.layers.{layer}.self_attn.{which}.weight"
            assert name in inits and [n.op_type for n in consumers[name]] == ["Mul"], name
    cache = next(i for i in model.graph.input if i.name == "key_cache.0")
    assert cache.type.tensor_type.shape.dim[3].dim_value == 24
    for node in _attention_nodes(folder):
        assert math.isclose(_attr(node, "scale"), 1 / math.sqrt(24), rel_tol=1e-6)


def test_without_the_qk_norm_the_logits_are_wrong(hf_model_dir, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The exactness tests can fail: the same export with the q/k norms left out is far from HF."""
    import octavo.export.checkpoint as checkpoint

    src = hf_model_dir("qwen3")
    ids = _prompt(Manifest.load(exported(src)).vocab_size)
    want = hf_prompt_logits(src, ids)
    np.testing.assert_allclose(prefill_logits(exported(src), ids), want, atol=ATOL, rtol=0)
    monkeypatch.setattr(checkpoint, "QK_NORM_ARCHITECTURES", ())
    export_model(src, tmp_path / "no_norm", progress=False)
    assert np.abs(prefill_logits(tmp_path / "no_norm", ids) - want).max() > 1e-2


@pytest.mark.parametrize("arch", ["qwen3tied", "qwen3window"])
def test_logits_match_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    src = hf_model_dir(arch)
    folder = exported(src)
    manifest = Manifest.load(folder)
    assert manifest.tie_word_embeddings is (arch == "qwen3tied")
    ids = _prompt(manifest.vocab_size)
    np.testing.assert_allclose(prefill_logits(folder, ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_attention_bias_on_q_k_v_and_o(tmp_path: Path) -> None:
    """attention_bias=True gives q/k/v AND o_proj biases in Qwen3 (random here, not HF's zeros)."""
    from safetensors.numpy import load_file, save_file

    src = make_random_model(tmp_path / "hf", "qwen3", attention_bias=True)
    weights = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(1)
    biases = [n for n in weights if n.endswith(".bias")]
    assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name in biases:
        weights[name] = rng.standard_normal(weights[name].shape).astype(np.float32)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    export_model(src, tmp_path / "out", progress=False)
    ids = _prompt(Manifest.load(tmp_path / "out").vocab_size)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_yarn_rope_scaling_as_qwen3_documents_it(tmp_path: Path) -> None:
    """Qwen3's long-context recipe is YaRN in rope_scaling; q/k norm and yarn together match transformers."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    src = make_random_model(tmp_path / "hf", "qwen3", rope_parameters=yarn)
    manifest = export_model(src, tmp_path / "out", progress=False)
    assert manifest.rope_scaling is not None and manifest.rope_scaling["rope_type"] == "yarn"
    ids = _prompt(manifest.vocab_size)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_engine_greedy_matches_transformers(hf_model_dir) -> None:  # noqa: ANN001
    src = hf_model_dir("qwen3tied")
    prompts = [_prompt(300, seed)[: 5 + 7 * seed] for seed in range(4)]
    got = llm_greedy(exported(src), prompts, 12, num_blocks=64, block_size=8, max_num_batched_tokens=16)
    for p, tokens in zip(prompts, got):
        assert tokens == hf_reference(src, p, 12)


# ----------------------------------------------------------------------------- sliding window rules
LAYERS4 = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.mark.parametrize("window", [
    dict(sliding_window=4096, use_sliding_window=False, max_window_layers=2),  # Qwen3's released configs
    dict(sliding_window=16, use_sliding_window=True, max_window_layers=2),
    dict(sliding_window=16, use_sliding_window=True),  # max_window_layers defaults to 28: no layer slides
    dict(sliding_window=16, use_sliding_window=True, max_window_layers=0),
    dict(sliding_window=16, use_sliding_window=True, layer_types=LAYERS4),
    dict(sliding_window=16, use_sliding_window=False, layer_types=LAYERS4),
    dict(sliding_window=None, use_sliding_window=True, max_window_layers=0),
])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_sliding_windows_per_layer_as_transformers(window: dict, arch: str) -> None:
    """Our per-layer windows from a raw config.json == the window each transformers attention layer uses
    (Qwen2 follows the same rules: use_sliding_window gates the window, also over layer_types)."""
    import transformers

    cls, config_cls = {"qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                       "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[arch]
    raw = dict(architectures=[cls.__name__], model_type=arch, vocab_size=32, hidden_size=16,
               intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
               **({"head_dim": 8} if arch == "qwen3" else {}), **window)
    model = cls(config_cls(**raw))
    want = [layer.self_attn.sliding_window or 0 for layer in model.model.layers]
    assert spec_from_config(raw).sliding_windows == want


def test_window_layers_in_graph_and_manifest(hf_model_dir) -> None:  # noqa: ANN001
    folder = exported(hf_model_dir("qwen3window"))
    assert [_attr(n, "sliding_window") for n in _attention_nodes(folder)] == [0, 8]
    assert Manifest.load(folder).sliding_window == 8


# ----------------------------------------------------------------------------- refused
def test_a_dense_model_written_as_qwen3moe_is_refused(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """A qwen3moe file without expert metadata (here: a dense qwen3 written under that name) is a clear error;
    real Qwen3-MoE files: tests/test_moe_gguf.py."""
    path = write_gguf(hf_model_dir("qwen3"), tmp_path / "moe.gguf", arch="qwen3moe")
    with pytest.raises(ModelFormatError, match="qwen3moe.expert_count must be a positive integer"):
        read_gguf(path)


# ----------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("variant", ["tied", "all_layers_window"])
def test_gguf_round_trip_logits_match_transformers(hf_model_dir, tmp_path: Path, variant: str) -> None:  # noqa: ANN001
    """HF -> octavo's GGUF writer (llama.cpp layout: attn_q_norm / attn_k_norm, key_length) -> read_gguf ->
    export: the logits equal the original transformers model's."""
    if variant == "tied":
        src = hf_model_dir("qwen3tied")
    else:
        src = make_random_model(tmp_path / "hf", "qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    path = write_gguf(src, tmp_path / "model.gguf")
    ckpt = read_gguf(path)
    assert ckpt.config["architectures"] == ["Qwen3ForCausalLM"] and ckpt.config["head_dim"] in (24, 32)
    assert "model.layers.1.self_attn.k_norm.weight" in ckpt.tensors
    manifest = export_model(path, tmp_path / "out", progress=False)
    assert manifest.architecture == "qwen3"
    windows = [_attr(n, "sliding_window") for n in _attention_nodes(tmp_path / "out")]
    assert windows == ([0, 0] if variant == "tied" else [8, 8])
    ids = _prompt(manifest.vocab_size)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_gguf_writer_refuses_a_window_on_some_layers_only(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(ModelFormatError, match="some layers only"):
        write_gguf(hf_model_dir("qwen3window"), tmp_path / "w.gguf")
    assert not (tmp_path / "w.gguf").exists()


def test_gguf_q_k_norm_on_another_architecture_is_refused(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """A llama-arch file carrying attn_q_norm tensors would run without them: refused, not ignored."""
    path = write_gguf(hf_model_dir("qwen3"), tmp_path / "as_llama.gguf", arch="llama")
    with pytest.raises(ModelFormatError, match="belongs to a qwen3 model"):
        read_gguf(path)
