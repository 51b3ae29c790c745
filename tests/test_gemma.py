"""Gemma 3 text (Gemma3ForCausalLM) and Gemma 2 (Gemma2ForCausalLM) exports against HF transformers.

The test models (tests/models.py) have random norm weights (so a missing `1 + w` shows), a sliding /
full / sliding layer mix with a window of 8 (shorter than every prompt here), and Gemma 3's local rope
theta (500) differs from its global one (10000, linear factor 8), so a layer rotated with the wrong table
shows; query_pre_attn_scalar (20) differs from head_dim (24). Gemma 2 has small attention and final
logit softcaps (5, 15), so a dropped cap shows. GGUF files: tests/test_gemma_gguf.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_helpers import exported, hf_reference, llm_greedy
from models import load_hf

from octavo.errors import UnsupportedArchitectureError
from octavo.export.checkpoint import spec_from_config
from octavo.export.manifest import Manifest
from octavo.export.rope import inv_freq
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
from octavo.runtime.backends.ort_fusions import fuse_rotary
from step_inputs import one_sequence

ATOL = 1e-4
BLOCK = 4
GEMMAS = ["gemma3", "gemma2"]


def _hf_logits(src: Path, ids: list[int], **config_changes: object) -> np.ndarray:
    """transformers' logits of every position of IDS (CONFIG_CHANGES override the checkpoint's config)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **config_changes).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _prompt(vocab_size: int, n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, n).tolist()


def _chunked_logits(folder: Path, ids: list[int], bounds: list[int]) -> np.ndarray:
    """Logits of every position of IDS, run as one sequence in the steps IDS[bounds[i]:bounds[i+1]] (a
    chunked prefill, then one-token decodes), over a reversed block table and a pool of noise."""
    manifest = Manifest.load(folder)
    blocks = -(-len(ids) // BLOCK)
    table = np.arange(blocks, dtype=np.int32)[::-1]
    backend = OnnxRuntimeBackend(folder, manifest, num_blocks=blocks, block_size=BLOCK, num_threads=1)
    rng = np.random.default_rng(7)
    for pool in backend.key_caches + backend.value_caches:
        pool[...] = rng.normal(0, 30, pool.shape)  # a read of a slot this run did not write is visible
    try:
        rows = [backend.run(one_sequence(ids[a:b], a, table, BLOCK, all_logits=True))
                for a, b in zip(bounds, bounds[1:])]
    finally:
        backend.close()
    return np.concatenate(rows)


# ----------------------------------------------------------------------------- config
def test_spec_matches_transformers_modules(hf_model_dir) -> None:  # noqa: ANN001
    """Every Gemma 3 number the graph uses, against the HF model's own modules and buffers."""
    src = hf_model_dir("gemma3")
    model = load_hf(src)[0]
    spec = spec_from_config(model.config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    inner = model.model
    assert np.float32(spec.embed_scale) == inner.embed_tokens.embed_scale.numpy()  # float32 sqrt(64)
    assert spec.norm_offset == 1.0 and spec.sandwich_norms and spec.qk_norm
    assert spec.hidden_act == model.config.hidden_activation == "gelu_pytorch_tanh"
    for layer, module in enumerate(inner.layers):
        assert spec.query_scale == pytest.approx(module.self_attn.scaling, rel=1e-12)
        assert spec.sliding_windows[layer] == (module.self_attn.sliding_window or 0)
        assert (layer in spec.local_rope_layers) == module.self_attn.is_sliding
    assert spec.local_rope_layers == [0, 2] and spec.sliding_windows == [8, 0, 8]
    rotary = inner.rotary_emb  # within 1 float32 ulp (torch divides by the linear factor in float32)
    np.testing.assert_allclose(inv_freq(spec.rope_theta, spec.head_dim, spec.rope_scaling),
                               rotary.full_attention_inv_freq.numpy(), rtol=1.2e-7, atol=0)
    np.testing.assert_allclose(inv_freq(spec.local_rope_theta, spec.head_dim, spec.local_rope_scaling),
                               rotary.sliding_attention_inv_freq.numpy(), rtol=1.2e-7, atol=0)
    assert spec.attn_softcap == 0.0 and spec.final_softcap == 0.0


def test_transformers4_config_layout_gives_the_same_spec() -> None:
    """A hub config.json of the transformers 4 era (rope_theta, rope_local_base_freq, rope_scaling for the
    global layers, sliding_window_pattern instead of layer_types) reads as transformers 5 reads it."""
    import transformers

    old = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=300, hidden_size=64,
               intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
               sliding_window_pattern=6, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k not in ("architectures", "model_type")})
    mine, theirs = spec_from_config(old), spec_from_config(hf.to_dict() | {"architectures": old["architectures"]})
    ignored = {"max_context", "tie_word_embeddings", "bos_token_id", "eos_token_ids", "pad_token_id"}  # defaults
    for name in set(type(mine).__dataclass_fields__) - ignored:
        assert getattr(mine, name) == getattr(theirs, name), name
    assert mine.local_rope_layers == [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"]
    assert mine.sliding_windows == [512] * 5 + [0, 512]
    assert (mine.rope_theta, mine.rope_scaling, mine.local_rope_theta, mine.local_rope_scaling) == (
        1_000_000.0, {"rope_type": "linear", "factor": 8.0}, 10_000.0, None)


# ----------------------------------------------------------------------------- logits and generation
@pytest.mark.parametrize("arch", GEMMAS)
def test_chunked_prefill_and_decode_logits_match_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    """A 30-token prompt (window 8) prefilled in chunks of 11, 9 and 10 tokens, then 6 decode steps."""
    src = hf_model_dir(arch)
    ids = _prompt(300, 36)
    got = _chunked_logits(exported(src), ids, [0, 11, 20, 30, 31, 32, 33, 34, 35, 36])
    np.testing.assert_allclose(got, _hf_logits(src, ids), rtol=0, atol=ATOL)


def test_gemma2_softcaps_matter(hf_model_dir) -> None:  # noqa: ANN001
    """The comparison above would fail without Gemma 2's caps: HF's logits move far beyond ATOL without them."""
    src = hf_model_dir("gemma2")
    ids = _prompt(300, 20)
    capped = _hf_logits(src, ids)
    assert np.abs(capped).max() < 15.0
    for change in ({"final_logit_softcapping": None}, {"attn_logit_softcapping": None}):
        assert np.abs(_hf_logits(src, ids, **change) - capped).max() > 100 * ATOL


@pytest.mark.parametrize("arch", GEMMAS)
def test_llm_greedy_matches_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    src = hf_model_dir(arch)
    prompts = [_prompt(300, n, seed) for seed, n in enumerate((3, 12, 23))]
    got = llm_greedy(exported(src), prompts, 14, num_blocks=64, block_size=8, max_num_batched_tokens=16)
    for p, tokens in zip(prompts, got):
        assert tokens == hf_reference(src, p, 14)


# ----------------------------------------------------------------------------- graph
@pytest.mark.parametrize("arch", GEMMAS)
def test_graph_attributes_and_every_rope_fused(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    folder = exported(hf_model_dir(arch))
    manifest = Manifest.load(folder)
    model = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    attention = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in attention]
    assert [a["sliding_window"] for a in attrs] == [8, 0, 8]
    assert all(a["scale"] == pytest.approx(20 ** -0.5, rel=1e-6) for a in attrs)  # linear rope: factor 1
    assert all(a["softcap"] == pytest.approx(5.0 if arch == "gemma2" else 0.0) for a in attrs)
    tables = {t.name for t in model.graph.initializer if t.name.startswith("rope.inv_freq")}
    assert tables == ({"rope.inv_freq", "rope.inv_freq.local"} if arch == "gemma3" else {"rope.inv_freq"})
    assert fuse_rotary(model, manifest.max_context) == 2 * manifest.num_layers
    assert [n.op_type for n in model.graph.node].count("RotaryEmbedding") == 2 * manifest.num_layers
    assert not {"Cos", "Sin", "Neg"} & {n.op_type for n in model.graph.node}
    assert manifest.architecture == arch and manifest.sliding_window == 8


# ----------------------------------------------------------------------------- refusals
def _config(**changes: object) -> dict:
    base = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=300, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    return base | changes


@pytest.mark.parametrize("changes, words", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "chunked_attention"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "dynamic"),
    (dict(architectures=["Gemma3ForConditionalGeneration"]), "Gemma3ForConditionalGeneration"),
])
def test_unsupported_gemma_configs_are_refused(changes: dict, words: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=words):
        spec_from_config(_config(**changes))
