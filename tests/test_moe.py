"""Mixture-of-Experts export (octavo/export/moe_spec.py, moe_graph.py; the op: tests/test_moe_op.py) against
transformers as the reference: Qwen3-MoE (top-k renormalised, q/k norm, a dense layer from mlp_only_layers, and a
decoder_sparse_step model with top-3 not renormalised), Qwen2-MoE (q/k/v bias, sigmoid-gated shared expert) and
Mixtral (sliding window 16 on every layer). Random router weights (no ties); norms randomised (tests/models.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_helpers import exported, hf_prompt_logits, hf_reference, llm_greedy, prefill_logits

from octavo.errors import ModelFormatError, UnsupportedArchitectureError
from octavo.export import export_model
from octavo.export.checkpoint import spec_from_config
from octavo.export.manifest import Manifest

ARCHS = ["qwen3_moe", "qwen3_moe_step", "qwen2_moe", "mixtral"]
ATOL = 1e-4
PROMPT_LEN = 40  # past mixtral's window of 16


def _prompt(vocab_size: int, seed: int = 3, length: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(seed).integers(5, vocab_size, length).tolist()  # no pad id 0 (HF generate masks it)


def _nodes(folder: Path, op_type: str) -> list[onnx.NodeProto]:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return [n for n in model.graph.node if n.op_type == op_type]


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _config(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())


# ----------------------------------------------------------------------------- spec, manifest, graph
@pytest.mark.parametrize(("arch", "sparse", "top_k", "normalize", "shared"), [
    ("qwen3_moe", [0, 2], 2, True, 0),  # mlp_only_layers [1]
    ("qwen3_moe_step", [1], 3, False, 0),  # decoder_sparse_step 2
    ("qwen2_moe", [0, 1], 2, False, 96),
    ("mixtral", [0, 1], 2, True, 0),  # Mixtral always renormalises
])
def test_expert_layout_in_manifest_and_graph(hf_model_dir, arch: str, sparse: list[int], top_k: int,  # noqa: ANN001
                                             normalize: bool, shared: int) -> None:
    src = hf_model_dir(arch)
    folder = exported(src)
    manifest = Manifest.load(folder)
    config = _config(src)
    experts = config.get("num_experts") or config["num_local_experts"]
    assert manifest.moe == {
        "num_experts": experts, "top_k": top_k,
        "expert_intermediate_size": config.get("moe_intermediate_size") or config["intermediate_size"],
        "normalize_top_k": normalize, "sparse_layers": sparse, "shared_expert_intermediate_size": shared,
        "op": "octavo.MoE", "expert_weights": "float32"}
    nodes = _nodes(folder, "MoE")
    assert len(nodes) == len(sparse)  # one node per sparse layer; dense layers keep their MLP
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    for node, layer in zip(nodes, sparse):
        assert node.domain == "octavo" and _attrs(node) == {"top_k": top_k, "normalize": int(normalize)}
        gate_up, down = node.input[2], node.input[3]
        assert f"layers.{layer}." in gate_up
        inter = manifest.moe["expert_intermediate_size"]
        assert shapes[gate_up] == [experts, 2 * inter, manifest.hidden_size]
        assert shapes[down] == [experts, manifest.hidden_size, inter]
    gates = [n for n in shapes if n.endswith("shared_expert_gate.weight")]  # Qwen2-MoE's shared expert
    assert len(gates) == (len(sparse) if shared else 0) and all(shapes[n] == [1, manifest.hidden_size] for n in gates)


def test_experts_are_the_checkpoints_bytes(hf_model_dir) -> None:  # noqa: ANN001
    """gate_up [E, 2I, H] holds each expert's gate rows then its up rows, down [E, H, I], as HF stores them."""
    from safetensors.numpy import load_file

    src = hf_model_dir("mixtral")
    folder = exported(src)
    tensors = load_file(str(src / "model.safetensors"))
    model = onnx.load(str(folder / "model.onnx"))  # with the external data
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    p = "model.layers.1.block_sparse_moe."
    for e in range(4):
        expert = p + f"experts.{e}."
        want = np.concatenate([tensors[expert + "w1.weight"], tensors[expert + "w3.weight"]])
        assert np.array_equal(inits[p + "experts.gate_up"][e], want)
        assert np.array_equal(inits[p + "experts.down"][e], tensors[expert + "w2.weight"])


def test_windows_and_qk_norm(hf_model_dir) -> None:  # noqa: ANN001
    mixtral = exported(hf_model_dir("mixtral"))
    assert [_attrs(n)["sliding_window"] for n in _nodes(mixtral, "PagedAttention")] == [16, 16]
    qwen3 = Manifest.load(exported(hf_model_dir("qwen3_moe")))
    assert (qwen3.architecture, qwen3.head_dim, qwen3.sliding_window) == ("qwen3_moe", 24, None)
    # Qwen3-MoE: transformers keeps sliding_window on every layer when use_sliding_window, else none
    config = _config(hf_model_dir("qwen3_moe")) | {"sliding_window": 8}
    assert spec_from_config(config).sliding_windows == [0, 0, 0]
    assert spec_from_config(config | {"use_sliding_window": True}).sliding_windows == [8, 8, 8]
    assert spec_from_config(config).qk_norm


# ----------------------------------------------------------------------------- exact against transformers
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    """A 40-token prompt in one step over a reversed block table: every position's logits within 1e-4 of
    transformers' float32 forward (measured: <= 5.2e-5; transformers' own float32 forward is up to 1.1e-4 from its
    float64 one on these models)."""
    src = hf_model_dir(arch)
    folder = exported(src)
    ids = _prompt(Manifest.load(folder).vocab_size)
    np.testing.assert_allclose(prefill_logits(folder, ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("arch", "change"), [
    ("qwen3_moe", {"norm_topk_prob": False}),   # renormalisation dropped
    ("mixtral", {"num_experts_per_tok": 1}),    # one expert fewer
    ("qwen2_moe", {"shared_expert_intermediate_size": None}),  # shared expert dropped (refused, see below)
])
def test_the_comparison_sees_the_routing(hf_model_dir, tmp_path: Path, arch: str, change: dict) -> None:  # noqa: ANN001
    """The exactness test can fail: the same weights exported with the routing changed are far from transformers."""
    src = hf_model_dir(arch)
    ids = _prompt(Manifest.load(exported(src)).vocab_size)
    want = hf_prompt_logits(src, ids)
    copy = tmp_path / "changed"
    shutil.copytree(src, copy)
    (copy / "config.json").write_text(json.dumps(_config(src) | change))
    if arch == "qwen2_moe":  # a Qwen2-MoE config without its shared expert is an error, not a silent drop
        with pytest.raises(ModelFormatError, match="shared_expert_intermediate_size"):
            export_model(copy, tmp_path / "out", progress=False)
        return
    export_model(copy, tmp_path / "out", progress=False)
    assert np.abs(prefill_logits(tmp_path / "out", ids) - want).max() > 1e-2


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                  pytest.param("mixtral", marks=pytest.mark.slow)])
def test_greedy_equals_transformers_batched_chunked_cached_preempted(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    """octavo.LLM's greedy tokens == transformers' for prompts of 5-70 tokens (some sharing a 24-token prefix),
    all at once with 16-token prefill chunks beside decodes, prefix caching, and a pool small enough to preempt."""
    src = hf_model_dir(arch)
    folder = exported(src)
    vocab = Manifest.load(folder).vocab_size
    shared = _prompt(vocab, seed=11, length=24)
    prompts = [_prompt(vocab, seed=s, length=n) for s, n in ((1, 5), (2, 70), (4, 33))]
    prompts += [shared + _prompt(vocab, seed=s, length=n) for s, n in ((5, 3), (6, 17), (7, 30))]
    want = [hf_reference(src, p, 12) for p in prompts]
    assert llm_greedy(folder, prompts, 12, max_num_batched_tokens=16, block_size=8, num_blocks=24,
                      enable_prefix_caching=True) == want
    assert llm_greedy(folder, prompts[1:2], 12) == want[1:2]  # alone


# ----------------------------------------------------------------------------- bad configs and checkpoints
def test_bad_moe_configs_are_clear_errors(hf_model_dir) -> None:  # noqa: ANN001
    config = _config(hf_model_dir("qwen3_moe"))
    for change, message in [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds the 8 experts"),
        ({"num_experts_per_tok": 0}, "'num_experts_per_tok' must be a positive integer"),
        ({"num_experts": 5000, "num_local_experts": 5000}, "5000 experts is more than octavo accepts"),
        ({"moe_intermediate_size": None}, "'moe_intermediate_size' is missing"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers must be a list of layer indices"),
        ({"decoder_sparse_step": -1}, "'decoder_sparse_step' must be a positive integer"),
    ]:
        with pytest.raises(ModelFormatError, match=message):
            spec_from_config(config | change)
    with pytest.raises(UnsupportedArchitectureError, match="OlmoeForCausalLM is not supported.*Qwen3MoeForCausalLM"):
        spec_from_config(config | {"architectures": ["OlmoeForCausalLM"]})


def test_a_missing_or_misshaped_expert_is_a_model_format_error(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    src = hf_model_dir("qwen3_moe")
    copy = tmp_path / "more_experts"
    shutil.copytree(src, copy)
    (copy / "config.json").write_text(json.dumps(_config(src) | {"num_experts": 9, "num_local_experts": 9}))
    with pytest.raises(ModelFormatError, match=r"tensor 'model.layers.0.mlp.gate.weight' has shape \(8, 64\), the "
                                               r"config implies \(9, 64\)"):
        export_model(copy, tmp_path / "out", progress=False)
    (copy / "config.json").write_text(json.dumps(_config(src) | {"moe_intermediate_size": 40}))
    with pytest.raises(ModelFormatError, match="experts.0.gate_proj.weight' has shape"):
        export_model(copy, tmp_path / "out2", progress=False)


def test_dense_manifests_are_unchanged(hf_model_dir) -> None:  # noqa: ANN001
    """A dense export's octavo.json has no moe entry (older octavo reads it), and loads with moe None."""
    folder = exported(hf_model_dir("llama"))
    assert "moe" not in json.loads((folder / "octavo.json").read_text())
    assert Manifest.load(folder).moe is None


def test_tensorrt_refuses_moe_before_touching_tensorrt(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """No GPU claim that did not run: the engine arguments, the builder and the ONNX rewrite each say why."""
    from octavo import LLM
    from octavo.errors import InvalidRequestError
    from octavo.tensorrt.builder import build_engine
    from octavo.tensorrt.onnx_rewrite import prepare_onnx_for_tensorrt

    folder = exported(hf_model_dir("qwen3_moe"))
    with pytest.raises(InvalidRequestError, match="Mixture-of-Experts model: its octavo.MoE nodes run on ONNX Runtime"):
        LLM(str(folder), backend="tensorrt")
    with pytest.raises(ModelFormatError, match="Mixture-of-Experts model"):
        build_engine(folder)
    with pytest.raises(ModelFormatError, match=r"octavo.MoE\): the export is a Mixture-of-Experts model"):
        prepare_onnx_for_tensorrt(folder / "model.onnx", tmp_path / "trt.onnx")
