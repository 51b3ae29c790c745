"""YaRN rope scaling against transformers: the inverse frequencies and attention factor octavo derives
from a config (every layout and default transformers accepts), the exported graph's logits past the
original context, greedy generation through octavo.LLM, the fused ONNX Runtime graph, the GGUF round
trip, and the rope types octavo refuses."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest

from octavo.errors import ModelFormatError, UnsupportedArchitectureError
from octavo.export.checkpoint import spec_from_config
from octavo.export.manifest import Manifest
from octavo.export.rope import attention_factor, inv_freq

# fp32 noise floor of these random models (logits up to ~16) over a 200-token prompt, measured: octavo vs
# transformers 1.8e-4 with DEFAULT rope (same prompt), 2.3e-4 at most with yarn; transformers' own fp32 vs
# fp64 forward 1.3e-4. 1e-4 holds only up to ~40 tokens. The nearest wrong yarns (attention factor left
# out, factor 4.1, truncate flipped) are >= 1.5 away (test_the_comparison_tells_yarns_apart).
ATOL = 4e-4
ORIGINAL = 64  # original_max_position_embeddings of the test models: prompts of 200 tokens run far past it
CONTEXT = 256  # max_position_embeddings = ORIGINAL x factor 4

# test model -> (tests/models.py arch, rope_scaling)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    "qwen2_yarn_mscale": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0}),
    "llama_yarn_betas": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                   "beta_fast": 16.0, "beta_slow": 2.0}),
    "llama_yarn_untruncated": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                         "attention_factor": 1.25, "truncate": False}),
}

# config.json layouts (what a checkpoint may carry) for the spec-level comparison
SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
             num_hidden_layers=1, num_attention_heads=4, vocab_size=32)
LAYOUTS: dict[str, dict[str, Any]] = {
    "defaults": dict(max_position_embeddings=256, rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2.5_legacy_type_key": dict(max_position_embeddings=131072, rope_theta=1000000.0, head_dim=128,
                                    num_attention_heads=2, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "transformers5_mscale_betas": dict(max_position_embeddings=4096, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    "mscale_without_all_dim": dict(max_position_embeddings=256, rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.5}),
    "attention_factor_untruncated": dict(max_position_embeddings=256, rope_theta=500000.0, rope_scaling={
        "rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64, "attention_factor": 1.5,
        "truncate": False}),
    "factor_from_context_ratio": dict(max_position_embeddings=512, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64, "factor": None}),
    "top_level_original_wins": dict(max_position_embeddings=512, original_max_position_embeddings=128,
                                    rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "original_defaults_to_context": dict(max_position_embeddings=64, rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 2.0}),
}


def hf_rotary(config: dict[str, Any]) -> tuple[np.ndarray, float]:
    """transformers' own rotary module for CONFIG: (inv_freq, attention_scaling)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    rotary = LlamaRotaryEmbedding(config=transformers.LlamaConfig(**kwargs))
    return rotary.inv_freq.numpy(), float(rotary.attention_scaling)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inv_freq_and_attention_factor_equal_transformers(layout: str) -> None:
    config = {**SHAPE, **LAYOUTS[layout]}
    want_freq, want_factor = hf_rotary(config)
    spec = spec_from_config(config)
    got = inv_freq(spec.rope_theta, spec.head_dim, spec.rope_scaling)
    assert got.dtype == np.float32
    # transformers' float32 arithmetic in its order; its float32 pow (theta^(2i/d)) is not always correctly
    # rounded, ours is: at most 1 ulp apart where it is not (1 of 64 values at theta 1e6, head_dim 128)
    np.testing.assert_array_max_ulp(got, want_freq, maxulp=1)
    assert (got == want_freq).mean() > 0.95
    assert attention_factor(spec.rope_scaling) == pytest.approx(want_factor, rel=1e-12)
    assert want_factor != 1.0  # every case scales cos and sin


# ----------------------------------------------------------------------------- tiny models, end to end
@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):  # noqa: ANN001, ANN201
    """Factory: name -> (HF folder, export folder, manifest, HF model); each made, exported, loaded once."""
    from models import load_hf, make_random_model

    from octavo.export import export_model

    made: dict[str, tuple[Path, Path, Manifest, Any]] = {}

    def get(name: str) -> tuple[Path, Path, Manifest, Any]:
        if name not in made:
            arch, scaling = MODELS[name]
            root = tmp_path_factory.mktemp(name)
            src = make_random_model(root / "hf", arch, max_position_embeddings=CONTEXT, rope_scaling=dict(scaling))
            manifest = export_model(src, root / "octavo", progress=False)
            made[name] = (src, root / "octavo", manifest, load_hf(src)[0])
        return made[name]

    return get


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def run_chunks(folder: Path, manifest: Manifest, ids: list[int], bounds: list[int],
               ort_fusions: bool = True) -> np.ndarray:
    """The prompt IDS prefilled in chunks (bounds), every logits row, over a reversed block table (ORT_FUSIONS:
    the backend's graph rewrites on or off)."""
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from step_inputs import one_sequence

    block_size, num_blocks = 16, -(-len(ids) // 16)
    table = np.arange(num_blocks, dtype=np.int32)[::-1].copy()
    backend = OnnxRuntimeBackend(folder, manifest, num_blocks, block_size, num_threads=1, ort_fusions=ort_fusions)
    try:
        rows = [backend.run(one_sequence(ids[a:b], a, table, block_size, all_logits=True))
                for a, b in zip(bounds, bounds[1:])]
    finally:
        backend.close()
    return np.concatenate(rows)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_past_the_original_context(yarn_model, name: str, fused: bool) -> None:  # noqa: ANN001
    """A 200-token prompt (the original context is 64) in a long prefill chunk, a short one and decode
    steps: every row equals transformers' logits, with the ORT rotary fusion on and off."""
    _, folder, manifest, model = yarn_model(name)
    ids = np.random.default_rng(11).integers(0, manifest.vocab_size, 200).tolist()
    got = run_chunks(folder, manifest, ids, [0, 150, 190, 191, 192, 200], ort_fusions=fused)
    want = hf_logits(model, ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert (got[ORIGINAL:].argmax(-1) == want[ORIGINAL:].argmax(-1)).all()


def test_the_comparison_tells_yarns_apart(yarn_model) -> None:
    """transformers' logits with a slightly wrong yarn are far outside ATOL: the logits test can fail."""
    import torch
    import transformers

    src, _, manifest, model = yarn_model("llama_yarn")
    ids = np.random.default_rng(11).integers(0, manifest.vocab_size, 200).tolist()
    want = hf_logits(model, ids)
    for change in ({"attention_factor": 1.0}, {"factor": 4.1}, {"truncate": False}):
        config = transformers.AutoConfig.from_pretrained(src)
        config.rope_parameters = {**config.rope_parameters, **change}
        wrong = transformers.AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32).eval()
        assert np.abs(hf_logits(wrong, ids) - want).max() > 1000 * ATOL, change


@pytest.mark.parametrize("name", MODELS)
def test_manifest_and_attention_scale_record_yarn(yarn_model, name: str) -> None:
    """The manifest carries yarn's parameters with every default written out; each PagedAttention node's
    scale is attention_factor^2 / sqrt(head_dim) (the factor transformers multiplies cos and sin by)."""
    src, folder, manifest, _ = yarn_model(name)
    _, want_factor = hf_rotary(json.loads((src / "config.json").read_text()))
    scaling = Manifest.load(folder).rope_scaling
    assert scaling is not None and scaling["rope_type"] == "yarn"
    for key, value in MODELS[name][1].items():
        assert scaling[key] == value
    assert scaling["attention_factor"] == pytest.approx(want_factor, rel=1e-12)
    assert {"beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"} <= set(scaling)
    graph = onnx.load(str(folder / manifest.onnx_file), load_external_data=False).graph
    scales = [a.f for n in graph.node if n.op_type == "PagedAttention" for a in n.attribute if a.name == "scale"]
    assert len(scales) == manifest.num_layers
    np.testing.assert_allclose(scales, want_factor**2 / math.sqrt(manifest.head_dim), rtol=1e-7)


@pytest.mark.parametrize("name", MODELS)
def test_rotary_fusion_still_applies(yarn_model, name: str) -> None:
    """The rope subgraph is the one ort_fusions matches: q and k of every layer become RotaryEmbedding."""
    from octavo.runtime.backends.ort_fusions import fuse_rotary

    _, folder, manifest, _ = yarn_model(name)
    model = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    assert fuse_rotary(model, manifest.max_context) == 2 * manifest.num_layers
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("RotaryEmbedding") == 2 * manifest.num_layers
    assert not {"Cos", "Sin"} & set(ops)


@pytest.mark.parametrize("name", ["llama_yarn", "qwen2_yarn_mscale"])
def test_greedy_generation_through_llm_equals_transformers(yarn_model, name: str) -> None:
    from engine_helpers import llm_greedy
    from models import hf_greedy

    _, folder, manifest, model = yarn_model(name)
    # no token 0: hf_greedy's generate() takes it for padding (pad_token_id=0) and would mask it out
    prompts = [np.random.default_rng(seed).integers(5, manifest.vocab_size, n).tolist()
               for seed, n in ((21, 200), (22, 90))]
    got = llm_greedy(folder, prompts, 24, num_blocks=48, block_size=16, max_num_batched_tokens=128)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(model, prompt, 24)


# ----------------------------------------------------------------------------- GGUF
def test_yarn_gguf_round_trip(yarn_model, tmp_path: Path) -> None:
    """octavo's GGUF writer stores yarn (type, factor, original context); read back through octavo's GGUF
    path the export gives transformers' logits of the original checkpoint."""
    import gguf

    from octavo.export import export_model
    from octavo.export.gguf_reader import read_gguf
    from octavo.export.gguf_writer import write_gguf

    src, _, _, model = yarn_model("llama_yarn")
    path = write_gguf(src, tmp_path / "yarn.gguf")
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["llama.rope.scaling.type"].contents() == "yarn"
    assert fields["llama.rope.scaling.factor"].contents() == 4.0
    assert fields["llama.rope.scaling.original_context_length"].contents() == ORIGINAL
    assert fields["llama.context_length"].contents() == CONTEXT
    assert read_gguf(path).config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": ORIGINAL}
    manifest = export_model(path, tmp_path / "out", progress=False)
    assert manifest.rope_scaling == Manifest.load(yarn_model("llama_yarn")[1]).rope_scaling
    ids = np.random.default_rng(5).integers(0, manifest.vocab_size, 160).tolist()
    got = run_chunks(tmp_path / "out", manifest, ids, [0, 100, 160])
    np.testing.assert_allclose(got, hf_logits(model, ids), rtol=0, atol=ATOL)


def _gguf_scaling(**keys: float) -> dict[str, Any] | None:
    from octavo.export.gguf_rope import rope_scaling_from_gguf

    meta = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768}
    meta.update({f"qwen2.rope.scaling.{k}": v for k, v in keys.items()})
    return rope_scaling_from_gguf(meta, SimpleNamespace(tensors=[]), "qwen2", 128, 1e6, "m.gguf")


def test_gguf_yarn_keys() -> None:
    """llama.cpp's beta keys map to HF's; neutral multipliers pass; others are refused, never guessed."""
    assert _gguf_scaling(yarn_beta_fast=16.0, yarn_beta_slow=2.0, yarn_ext_factor=-1.0, yarn_attn_factor=1.0) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 16.0, "beta_slow": 2.0}
    for key, value in (("yarn_attn_factor", 0.8), ("yarn_ext_factor", 0.5), ("yarn_log_multiplier", 0.1),
                       ("attn_factor", 2.0)):
        with pytest.raises(ModelFormatError, match=key):
            _gguf_scaling(**{key: value})


# ----------------------------------------------------------------------------- refused rope types
@pytest.mark.parametrize(("config", "kind", "why"), [
    (dict(rope_theta=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic", "batch"),
    (dict(rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic", "batch"),
], ids=["dynamic", "dynamic_legacy_key"])
def test_dynamic_is_refused_naming_what_is_supported(config: dict[str, Any], kind: str, why: str) -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        spec_from_config({**SHAPE, "max_position_embeddings": 256, **config})
    message = str(info.value)
    assert repr(kind) in message and why in message
    assert "default, linear, llama3, yarn, longrope" in message


@pytest.mark.parametrize("config", [
    dict(rope_theta=10000.0, partial_rotary_factor=0.5),
    dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.5}),
], ids=["top_level", "in_rope_parameters"])
def test_partial_rotary_is_refused(config: dict[str, Any]) -> None:
    """A Llama config with partial_rotary_factor: transformers' Llama attention does not slice the rotated part, so
    only Phi-3 (PARTIAL_ROTARY_ARCHITECTURES) takes one; refused naming the value."""
    with pytest.raises(UnsupportedArchitectureError, match="partial_rotary_factor"):
        spec_from_config({**SHAPE, "max_position_embeddings": 256, **config})


def test_yarn_gguf_keeps_the_betas_and_refuses_what_it_cannot_hold(yarn_model, tmp_path: Path) -> None:
    """beta_fast / beta_slow go into llama.cpp's yarn_beta_* keys and come back (same logits as the HF
    model that has them); mscale / attention_factor / truncate=False have no GGUF key: refused, no file."""
    import gguf

    from octavo.errors import ModelFormatError
    from octavo.export import export_model
    from octavo.export.gguf_writer import write_gguf

    src, _, _, model = yarn_model("llama_yarn_betas")
    path = write_gguf(src, tmp_path / "betas.gguf")
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["llama.rope.scaling.yarn_beta_fast"].contents() == 16.0
    assert fields["llama.rope.scaling.yarn_beta_slow"].contents() == 2.0
    manifest = export_model(path, tmp_path / "out", progress=False)
    ids = np.random.default_rng(6).integers(1, manifest.vocab_size, 160).tolist()
    got = run_chunks(tmp_path / "out", manifest, ids, [0, 100, 160])
    np.testing.assert_allclose(got, hf_logits(model, ids), rtol=0, atol=ATOL)
    for name in ("qwen2_yarn_mscale", "llama_yarn_untruncated"):
        with pytest.raises(ModelFormatError, match="cannot be written to GGUF"):
            write_gguf(yarn_model(name)[0], tmp_path / f"{name}.gguf")
        assert not (tmp_path / f"{name}.gguf").exists()
