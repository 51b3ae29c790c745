"""LongRoPE and partial rotary (Phi-3.5-mini 128k, Phi-4-mini: `Phi3ForCausalLM`) against transformers.

The tiny models (tests/models.py) have original_max_position_embeddings 32 and a context of 1024, so the
export uses the long factors (octavo picks one set per export: module docstring of octavo.export.rope), and
transformers uses them for any sequence longer than 32: every prompt here that is compared with it is.
`phi4mini` rotates 12 of each head's 16 values (partial_rotary_factor 0.75) and its longrope attention factor
scales only those. A model whose context is its original one uses the short factors (`_short_context`).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import exported, hf_prompt_logits, hf_reference, llm_greedy, prefill_logits
from models import LONGROPE_LONG, LONGROPE_SHORT, load_hf

from octavo.errors import ModelFormatError
from octavo.export import export_model
from octavo.export.checkpoint import spec_from_config
from octavo.export.gguf_reader import read_gguf
from octavo.export.gguf_writer import write_gguf
from octavo.export.rope import attention_factor, inv_freq

ATOL = 1e-4
ORIGINAL = 32
ARCHS = ["phi3longrope", "phi4mini"]
# the engine tests run phi4mini by default (partial rotary and longrope both) and phi3longrope with -m slow
ENGINE_ARCHS = [pytest.param("phi3longrope", marks=pytest.mark.slow), "phi4mini"]


def _prompt(n: int, seed: int = 3) -> list[int]:
    """N random ids; never 0: models.hf_greedy's pad id, which transformers' generate would mask out."""
    return np.random.default_rng(seed).integers(1, 300, n).tolist()


def _short_context(src: Path, dst: Path, **rope_changes: object) -> Path:
    """SRC with max_position_embeddings = the original 32 (the short factors) and ROPE_CHANGES."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = ORIGINAL
    config["rope_parameters"] = config["rope_parameters"] | rope_changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_frequencies_and_attention_factor_are_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    """inv_freq and the attention factor == transformers' longrope init for a sequence past the original context."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = load_hf(hf_model_dir(arch))[0]
    spec = spec_from_config(model.config.to_dict() | {"architectures": ["Phi3ForCausalLM"]})
    assert spec.rope_scaling["factors"] == "long" and spec.rotary_size == (12 if arch == "phi4mini" else 16)
    want, factor = ROPE_INIT_FUNCTIONS["longrope"](model.config, None, seq_len=ORIGINAL + 1)
    np.testing.assert_allclose(inv_freq(spec.rope_theta, spec.rotary_size, spec.rope_scaling), want.numpy(),
                               rtol=1.2e-7, atol=0)
    assert attention_factor(spec.rope_scaling) == pytest.approx(factor, rel=1e-12)
    assert factor == pytest.approx(math.sqrt(1 + math.log(1024 / ORIGINAL) / math.log(ORIGINAL)))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_past_the_original_context_match_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    src = hf_model_dir(arch)
    ids = _prompt(45)
    np.testing.assert_allclose(prefill_logits(exported(src), ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_short_factors_when_the_context_is_the_original_one(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """max_position_embeddings 32 = the original: the short factors (and an explicit attention factor), as
    transformers uses them for any sequence that fits; the long-factor export differs on the same prompt."""
    src = _short_context(hf_model_dir("phi4mini"), tmp_path / "hf", attention_factor=1.25)
    manifest = export_model(src, tmp_path / "out", progress=False)
    assert manifest.rope_scaling["factors"] == "short" and manifest.rope_scaling["attention_factor"] == 1.25
    ids = _prompt(ORIGINAL)
    want = hf_prompt_logits(src, ids)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), want, atol=ATOL, rtol=0)
    assert np.abs(prefill_logits(exported(hf_model_dir("phi4mini")), ids) - want).max() > 1e-2


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_an_engine_context_within_the_original_one_uses_the_short_factors(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    """The long-factor export served with max_model_len 32 (vLLM's rule: long only when max_model_len exceeds
    the original context) rotates with the short factors: logits of 32 tokens and greedy continuations that
    stay within 32 tokens (transformers uses the short factors throughout) equal transformers'."""
    from step_inputs import one_sequence

    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    src, folder = hf_model_dir(arch), exported(hf_model_dir(arch))
    ids = _prompt(ORIGINAL)
    backend = OnnxRuntimeBackend(folder, Manifest.load(folder), num_blocks=2, block_size=16, num_threads=1,
                                 max_model_len=ORIGINAL)
    try:
        got = backend.run(one_sequence(ids, 0, np.arange(2, dtype=np.int32)[::-1], 16, all_logits=True))
    finally:
        backend.close()
    np.testing.assert_allclose(got, hf_prompt_logits(src, ids), atol=ATOL, rtol=0)
    prompts = [_prompt(12 + 4 * seed, seed) for seed in range(3)]  # + 10 tokens: at most 30
    got_tokens = llm_greedy(folder, prompts, 10, num_blocks=16, block_size=8, max_model_len=ORIGINAL)
    for p, tokens in zip(prompts, got_tokens):
        assert tokens == hf_reference(src, p, 10)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_greedy_under_batching_and_preemption_matches_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    """Prompts of 33..48 tokens (past the original 32), 10 new tokens each, 16-token steps in a pool of 14
    blocks of 8 that cannot hold all three at once (preemption, recompute)."""
    src = hf_model_dir(arch)
    prompts = [_prompt(33 + 7 * seed, seed) for seed in range(3)]
    got = llm_greedy(exported(src), prompts, 10, num_blocks=14, block_size=8, max_num_batched_tokens=16)
    for p, tokens in zip(prompts, got):
        assert tokens == hf_reference(src, p, 10)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_round_trip_matches_transformers(hf_model_dir, tmp_path: Path, arch: str) -> None:  # noqa: ANN001
    """llama.cpp's layout: rope_factors_long/short tensors, the attention factor and the original context as
    keys, rope.dimension_count = the rotated part; transformers' own GGUF loader reads the file's tensors back
    as the HF ones; octavo's export of the file == transformers' logits."""
    import gguf
    from safetensors.numpy import load_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = hf_model_dir(arch)
    path = write_gguf(src, tmp_path / "model.gguf")
    raw = gguf.GGUFReader(path)
    tensors = {t.name: np.asarray(t.data) for t in raw.tensors}
    np.testing.assert_array_equal(tensors["rope_factors_long.weight"], np.float32(LONGROPE_LONG[:len(
        tensors["rope_factors_long.weight"])]))
    np.testing.assert_array_equal(tensors["rope_factors_short.weight"][:2], np.float32(LONGROPE_SHORT[:2]))
    assert raw.fields["phi3.rope.dimension_count"].contents() == (12 if arch == "phi4mini" else 16)
    assert raw.fields["phi3.rope.scaling.original_context_length"].contents() == ORIGINAL
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=load_hf(src)[0])["tensors"]
    for name, value in load_file(str(src / "model.safetensors")).items():
        if name in theirs:
            np.testing.assert_array_equal(np.asarray(theirs[name]), value)

    config = read_gguf(path).config
    assert config["rope_scaling"]["rope_type"] == "longrope"
    assert config.get("partial_rotary_factor", 1.0) == (0.75 if arch == "phi4mini" else 1.0)
    export_model(path, tmp_path / "out", progress=False)
    ids = _prompt(45)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_released_phi4_mini_config_as_transformers_reads_it() -> None:
    """Phi-4-mini-instruct's config.json (the fields octavo reads): 96 of 128 values rotate, long factors
    (131072 > 4096), transformers' attention factor."""
    config = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
                  num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
                  max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                  rope_theta=10000.0, tie_word_embeddings=True, sliding_window=262144,
                  rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    spec = spec_from_config(config)
    assert (spec.head_dim, spec.rotary_size) == (128, 96)
    assert spec.rope_scaling["factors"] == "long"
    assert spec.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize("changes, words", [
    (dict(long_factor=[2.0] * 7), "long_factor has 7 values"),
    (dict(short_factor=[1.0, -1.0] + [1.0] * 6), "positive numbers"),
])
def test_bad_factors_are_refused(hf_model_dir, changes: dict, words: str) -> None:  # noqa: ANN001
    config = json.loads((hf_model_dir("phi3longrope") / "config.json").read_text())
    config["rope_parameters"] = config["rope_parameters"] | changes
    with pytest.raises(ModelFormatError, match=words):
        spec_from_config(config)
