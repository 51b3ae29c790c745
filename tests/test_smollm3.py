"""SmolLM3 (`SmolLM3ForCausalLM`): a Llama whose layers listed 0 in `no_rope_layers` attend without rotary
embedding (NoPE), against transformers.

The test model (tests/models.py) has 4 layers, layers 1 and 3 without rope, random norm weights. GGUF files
(llama.cpp arch "smollm3": Llama's tensors with q/k permuted) store no layer list: llama.cpp leaves rope out
of every 4th layer, as transformers' default no_rope_layer_interval does.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_helpers import exported, hf_prompt_logits, hf_reference, llm_greedy, prefill_logits
from models import load_hf

from octavo.errors import ModelFormatError
from octavo.export import export_model
from octavo.export.checkpoint import spec_from_config
from octavo.export.gguf_reader import read_gguf
from octavo.export.gguf_writer import write_gguf
from octavo.export.manifest import Manifest

ATOL = 1e-4


def _prompt(n: int, seed: int = 3) -> list[int]:
    """N random ids; never 0: models.hf_greedy's pad id, which transformers' generate would mask out."""
    return np.random.default_rng(seed).integers(1, 300, n).tolist()


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_spec_matches_transformers_modules(hf_model_dir) -> None:  # noqa: ANN001
    model = load_hf(hf_model_dir("smollm3"))[0]
    spec = spec_from_config(model.config.to_dict() | {"architectures": ["SmolLM3ForCausalLM"]})
    assert spec.architecture == "smollm3" and spec.nope_layers == [1, 3]
    assert [i for i, layer in enumerate(model.model.layers) if not layer.self_attn.use_rope] == spec.nope_layers
    assert spec.sliding_windows == [0] * 4


def test_released_config_layout() -> None:
    """SmolLM3-3B's config.json: no_rope_layers listed, no sliding window; without the list, transformers'
    default (every no_rope_layer_interval-th layer) and its layer types (sliding on NoPE layers when
    use_sliding_window is on)."""
    import transformers

    base = dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", vocab_size=128256, hidden_size=2048,
                intermediate_size=11008, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                rope_theta=5000000.0, max_position_embeddings=65536, use_sliding_window=False, sliding_window=None)
    assert spec_from_config(base | {"no_rope_layers": [1, 1, 1, 0] * 2}).nope_layers == [3, 7]
    assert spec_from_config(base | {"no_rope_layer_interval": 3}).nope_layers == [2, 5]
    windowed = base | {"use_sliding_window": True, "sliding_window": 64}
    hf = transformers.SmolLM3Config(**{k: v for k, v in windowed.items() if k not in ("architectures", "model_type")})
    want = [64 if t == "sliding_attention" else 0 for t in hf.layer_types]
    assert spec_from_config(windowed).sliding_windows == want == [0, 0, 0, 64, 0, 0, 0, 64]


@pytest.mark.parametrize("flags", [[1, 0, 1], [1, 2, 1, 0], "1010"])
def test_bad_no_rope_layers_are_refused(flags: object) -> None:
    config = dict(architectures=["SmolLM3ForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, no_rope_layers=flags)
    with pytest.raises(ModelFormatError, match="no_rope_layers"):
        spec_from_config(config)


def test_logits_match_transformers_and_nope_matters(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """Prefill logits == transformers'; the NoPE layers' attention nodes read unrotated q/k (no rope
    subgraph feeds them), and the same weights with rope on every layer give other logits."""
    src = hf_model_dir("smollm3")
    folder = exported(src)
    ids = _prompt(40)
    want = hf_prompt_logits(src, ids)
    np.testing.assert_allclose(prefill_logits(folder, ids), want, atol=ATOL, rtol=0)
    all_rope = _with_config(src, tmp_path / "hf", no_rope_layers=[1, 1, 1, 1])
    export_model(all_rope, tmp_path / "out", progress=False)
    assert np.abs(prefill_logits(tmp_path / "out", ids) - want).max() > 1e-2
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "Cos" for n in graph.node) == 1  # one table, shared by the rope layers
    assert Manifest.load(folder).architecture == "smollm3"


def test_greedy_under_batching_and_preemption_matches_transformers(hf_model_dir) -> None:  # noqa: ANN001
    src = hf_model_dir("smollm3")
    prompts = [_prompt(9 + 8 * seed, seed) for seed in range(3)]
    got = llm_greedy(exported(src), prompts, 12, num_blocks=9, block_size=8, max_num_batched_tokens=16)
    for p, tokens in zip(prompts, got):
        assert tokens == hf_reference(src, p, 12)


def test_gguf_round_trip_matches_transformers(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """llama.cpp's smollm3 file (q/k rows permuted as for llama) with rope left out of every 4th layer."""
    src = _with_config(hf_model_dir("smollm3"), tmp_path / "hf", no_rope_layers=[1, 1, 1, 0])
    path = write_gguf(src, tmp_path / "model.gguf")
    ckpt = read_gguf(path)
    assert ckpt.config["architectures"] == ["SmolLM3ForCausalLM"]
    assert spec_from_config(ckpt.config).nope_layers == [3]
    export_model(path, tmp_path / "out", progress=False)
    ids = _prompt(40)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_gguf_writer_refuses_layers_llama_cpp_cannot_express(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(ModelFormatError, match="every 4th layer"):
        write_gguf(hf_model_dir("smollm3"), tmp_path / "model.gguf")  # NoPE layers 1 and 3
    assert not (tmp_path / "model.gguf").exists()


def test_yarn_scales_the_rope_layers_only(tmp_path: Path) -> None:
    """SmolLM3's long-context setting (yarn): its attention factor reaches the rope layers' scale only; the NoPE
    layers keep 1/sqrt(head_dim), as transformers (no cos/sin there)."""
    from models import make_random_model

    src = make_random_model(tmp_path / "hf", "smollm3", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    export_model(src, tmp_path / "out", progress=False)
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    scales = [next(a.f for a in n.attribute if a.name == "scale") for n in graph.node if n.op_type == "PagedAttention"]
    assert scales[1] == scales[3] == pytest.approx(16 ** -0.5) and scales[0] > scales[1]
    ids = _prompt(45)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)
