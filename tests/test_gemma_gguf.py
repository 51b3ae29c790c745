"""Gemma 2 / Gemma 3 text GGUF files (llama.cpp's "gemma2" / "gemma3") against transformers.

The files are written by octavo's writer in llama.cpp's layout (norms stored plus 1, the sandwich norms under
post_attention_norm / ffn_norm / post_ffw_norm, q/k unpermuted); transformers' own GGUF loader reads their
tensors back as the HF ones, which checks that layout independently of octavo's reader. The tiny models are
tests/models.py's, with query_pre_attn_scalar = head_dim, which is what llama.cpp assumes below 27B (it
stores no scalar). Their sliding / full / sliding layers differ from llama.cpp's default pattern for Gemma 3
(every 6th layer full), so that file carries the per-layer sliding_window_pattern array; Gemma 3's global
layers keep their linear rope factor (8), the local ones none.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import hf_prompt_logits, hf_reference, llm_greedy, prefill_logits
from models import load_hf, make_random_model

from octavo.errors import ModelFormatError
from octavo.export import export_model
from octavo.export.checkpoint import spec_from_config
from octavo.export.gguf_gemma import layer_types, query_pre_attn_scalar
from octavo.export.gguf_reader import read_gguf
from octavo.export.gguf_writer import write_gguf

ATOL = 1e-4
GEMMAS = ["gemma2", "gemma3"]
HF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _prompt(n: int, seed: int = 3) -> list[int]:
    """N random ids; never 0: models.hf_greedy's pad id, which transformers' generate would mask out."""
    return np.random.default_rng(seed).integers(1, 300, n).tolist()


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):  # noqa: ANN001, ANN201
    """arch -> (HF folder, its GGUF file, the file's export), made once per module."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path, Path]:
        if arch not in made:
            root = tmp_path_factory.mktemp(f"gguf_{arch}")
            src = make_random_model(root / "hf", arch, query_pre_attn_scalar=24)
            path = write_gguf(src, root / "model.gguf", tensor_type="F32")
            export_model(path, root / "out", progress=False)
            made[arch] = (src, path, root / "out")
        return made[arch]

    return get


@pytest.mark.parametrize("arch", GEMMAS)
def test_file_layout_is_llama_cpps(gemma_gguf, arch: str) -> None:  # noqa: ANN001
    """Norms stored as 1 + w; transformers' GGUF loader (which subtracts the 1 itself) gives back every HF tensor."""
    import gguf
    from safetensors.numpy import load_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src, path, _ = gemma_gguf(arch)
    weights = load_file(str(src / "model.safetensors"))
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    np.testing.assert_array_equal(stored["blk.1.ffn_norm.weight"],
                                  weights["model.layers.1.pre_feedforward_layernorm.weight"] + np.float32(1))
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= stored.keys()
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=load_hf(src)[0])["tensors"]
    assert set(weights) - {"lm_head.weight"} <= set(theirs)
    for name, value in weights.items():
        if name in theirs:
            # a norm's (w + 1) - 1 is w within one float32 ulp of values in [1, 2)
            np.testing.assert_allclose(np.asarray(theirs[name]), value, rtol=0, atol=2.5e-7)


@pytest.mark.parametrize("arch", GEMMAS)
def test_config_read_back_is_the_models(gemma_gguf, arch: str) -> None:  # noqa: ANN001
    src, path, _ = gemma_gguf(arch)
    mine = spec_from_config(read_gguf(path).config)
    theirs = spec_from_config(load_hf(src)[0].config.to_dict() | {"architectures": [HF_ARCHITECTURES[arch]]})
    for name in ("architecture", "norm_offset", "embed_scale", "sandwich_norms", "hidden_act", "query_scale",
                 "attn_softcap", "final_softcap", "sliding_windows", "qk_norm", "rope_theta", "rope_scaling",
                 "local_rope_theta", "local_rope_scaling", "local_rope_layers", "head_dim", "num_kv_heads"):
        assert getattr(mine, name) == pytest.approx(getattr(theirs, name)), name


@pytest.mark.parametrize("arch", GEMMAS)
def test_logits_match_transformers(gemma_gguf, arch: str) -> None:  # noqa: ANN001
    """36 tokens (window 8), one prefill."""
    src, _, folder = gemma_gguf(arch)
    ids = _prompt(36)
    np.testing.assert_allclose(prefill_logits(folder, ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_greedy_under_batching_and_preemption_matches_transformers(gemma_gguf) -> None:  # noqa: ANN001
    src, _, folder = gemma_gguf("gemma3")
    prompts = [_prompt(9 + 8 * seed, seed) for seed in range(3)]
    got = llm_greedy(folder, prompts, 12, num_blocks=9, block_size=8, max_num_batched_tokens=16)
    for p, tokens in zip(prompts, got):
        assert tokens == hf_reference(src, p, 12)


# ----------------------------------------------------------------------------- what llama.cpp fixes, not stores
def test_llama_cpp_defaults_for_what_a_file_does_not_store() -> None:
    """Layer pattern: every 2nd (Gemma 2) / 6th (Gemma 3) layer global, unless sliding_window_pattern says;
    query_pre_attn_scalar: hidden / heads for the 27B models (46 / 62 layers: 4608 / 32 = 144, 5376 / 32 =
    168, as their configs say), head_dim otherwise (256 for Gemma 3 1B/4B/12B, Gemma 2 2B/9B)."""
    assert layer_types({}, "gemma2", 4, "f") == ["sliding_attention", "full_attention"] * 2
    assert layer_types({}, "gemma3", 7, "f") == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    pattern = {"gemma3.attention.sliding_window_pattern": [True, False]}
    assert layer_types(pattern, "gemma3", 2, "f") == ["sliding_attention", "full_attention"]
    with pytest.raises(ModelFormatError, match="one boolean per layer"):
        layer_types(pattern, "gemma3", 3, "f")
    gemma2_27b = dict(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32, head_dim=128)
    gemma3_27b = dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128)
    gemma3_4b = dict(num_hidden_layers=34, hidden_size=2560, num_attention_heads=8, head_dim=256)
    assert query_pre_attn_scalar({}, "gemma2", gemma2_27b) == 144
    assert query_pre_attn_scalar({}, "gemma3", gemma3_27b) == 168
    assert query_pre_attn_scalar({}, "gemma3", gemma3_4b) == 256
    assert query_pre_attn_scalar({"gemma3.attention.scale": 0.125}, "gemma3", gemma3_4b) == 64


def test_writer_refuses_a_scalar_llama_cpp_would_not_derive(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """tests/models.py's gemma3 has query_pre_attn_scalar 20 != head_dim 24: llama.cpp would run it with 24."""
    with pytest.raises(ModelFormatError, match="query_pre_attn_scalar"):
        write_gguf(hf_model_dir("gemma3"), tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


@pytest.mark.parametrize("arch", [pytest.param("gemma2", marks=pytest.mark.slow), "gemma3"])
def test_q8_0_file_on_its_own_blocks_matches_transformers_gguf_weights(tmp_path: Path, arch: str) -> None:
    """A Q8_0 file exported with its own blocks (weights "gguf", the default) == transformers' model with
    the state dict transformers' GGUF loader makes of the same file (dequantized, norms minus 1)."""
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = make_random_model(tmp_path / "hf", arch, query_pre_attn_scalar=24)
    path = write_gguf(src, tmp_path / "model.gguf", tensor_type="Q8_0")
    manifest = export_model(path, tmp_path / "out", progress=False)
    assert manifest.weights == "gguf"
    model = load_hf(src)[0]
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=False)
    ids = _prompt(36)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(want - hf_prompt_logits(src, ids)).max() > 1e-2  # the quantization shows
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), want, atol=ATOL, rtol=0)


def test_gemma3_file_without_a_window_attends_fully_everywhere() -> None:
    """llama.cpp runs a gemma3 file without attention.sliding_window with full attention on every layer and the
    global rope base; the reader says the same (a gemma2 file gets llama.cpp's default window, 4096)."""
    from octavo.export.gguf_gemma import gemma_config

    base = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, head_dim=24)
    gemma3 = spec_from_config(gemma_config({}, "gemma3", base, "f") | dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=32, intermediate_size=128))
    assert gemma3.sliding_windows == [0, 0, 0] and gemma3.local_rope_layers == []
    assert gemma_config({}, "gemma2", base, "f")["sliding_window"] == 4096
