"""Mixture-of-Experts GGUF files (octavo/export/gguf_moe.py; llama.cpp's qwen3moe / qwen2moe / llama-with-experts
layout) written by octavo's GGUF writer from the random models of tests/models.py, read back and exported, against
transformers: on the original weights for F32 files, on the file's dequantized values for quantized ones (as the
dense GGUF tests do). Quantized experts run in the file's own blocks (octavo.MoE's block path)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_helpers import hf_prompt_logits, llm_greedy, prefill_logits
from models import hf_greedy, load_hf, make_random_model

from octavo.errors import ModelFormatError
from octavo.export import export_model
from octavo.export.gguf_reader import read_gguf
from octavo.export.gguf_writer import write_gguf

ATOL = 1e-4
PROMPT_LEN = 40  # past 8 rows: the block kernel's float32 path, over the file's exact values
EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}


@pytest.fixture(scope="module")
def hf_moe(hf_model_dir):  # noqa: ANN001, ANN201
    """arch -> the session's random MoE checkpoint (tests/models.py: expert widths are multiples of 32)."""
    return hf_model_dir


def _prompt(vocab: int, length: int = PROMPT_LEN, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(5, vocab, length).tolist()  # no pad id 0: HF generate masks it


def _dequantized_hf(gguf_path: Path, src: Path, dst: Path) -> Path:
    """An HF folder (SRC's config and tokenizer) holding the GGUF's dequantized values under HF's names: the
    experts split per expert again, the shared expert's gate [1, H]."""
    from safetensors.numpy import save_file

    ckpt = read_gguf(gguf_path)
    names = EXPERT_NAMES.get(json.loads((src / "config.json").read_text())["model_type"], {})
    state: dict[str, np.ndarray] = {}
    for name in ckpt.tensors:
        value = ckpt.tensors[name]
        if ".experts." in name and value.ndim == 3:
            prefix, which = name.split(".experts.")[0], name.split(".experts.")[1].split(".")[0]
            for e in range(value.shape[0]):
                state[f"{prefix}.experts.{e}.{names.get(which, which)}.weight"] = np.ascontiguousarray(value[e])
        else:
            state[name] = value.reshape(1, -1) if name.endswith("shared_expert_gate.weight") else value
    shutil.copytree(src, dst)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _moe_nodes(folder: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node if n.op_type == "MoE"]


@pytest.mark.parametrize(("arch", "model_type", "gguf_arch"), [
    ("qwen3_moe", "qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2_moe", "qwen2moe"), ("mixtral", "mixtral", "llama")])
def test_f32_round_trip_matches_transformers(hf_moe, tmp_path: Path, arch: str, model_type: str,  # noqa: ANN001
                                             gguf_arch: str) -> None:
    src = hf_moe(arch)
    path = write_gguf(src, tmp_path / "m.gguf")
    ckpt = read_gguf(path)
    config = json.loads((src / "config.json").read_text())
    assert ckpt.metadata["general.architecture"] == gguf_arch and ckpt.config["model_type"] == model_type
    assert ckpt.config["num_experts_per_tok"] == config["num_experts_per_tok"]
    assert ckpt.config["norm_topk_prob"] == (config.get("norm_topk_prob", True) if arch != "mixtral" else True)
    assert ckpt.config["mlp_only_layers"] == config.get("mlp_only_layers", [])
    manifest = export_model(path, tmp_path / "out", progress=False)
    assert manifest.architecture == model_type and manifest.moe["expert_weights"] == "float32"
    ids = _prompt(manifest.vocab_size)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("arch", "qtype"), [("qwen3_moe", "Q8_0"), ("qwen2_moe", "Q4_0"), ("mixtral", "Q4_1")])
def test_quantized_experts_run_in_the_files_blocks(hf_moe, tmp_path: Path, arch: str, qtype: str) -> None:  # noqa: ANN001
    """The experts stay in the file's blocks (uint8 codes, no float32 copy) and the logits of a 40-token prompt
    match transformers on the file's dequantized values."""
    src = hf_moe(arch)
    path = write_gguf(src, tmp_path / f"m.{qtype}.gguf", tensor_type=qtype)
    manifest = export_model(path, tmp_path / "out", progress=False)
    assert manifest.weights == "gguf" and manifest.moe["expert_weights"] == "gguf"
    model = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    for node in _moe_nodes(tmp_path / "out"):
        assert len(node.input) == 9 and inits[node.input[2]].data_type == onnx.TensorProto.UINT8
        assert not any(name.endswith("experts.gate_up") for name in inits)  # no float32 experts
    reference = _dequantized_hf(path, src, tmp_path / "dequantized")
    ids = _prompt(manifest.vocab_size)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(reference, ids), atol=ATOL,
                               rtol=0)


def test_quantized_greedy_equals_transformers_batched(hf_moe, tmp_path: Path) -> None:  # noqa: ANN001
    """Greedy through octavo.LLM on a Q8_0 file (prefill chunks on the float32 path, decode steps of several
    sequences on the 16-bit path) == transformers' greedy on the file's dequantized values."""
    src = hf_moe("qwen3_moe")
    path = write_gguf(src, tmp_path / "m.Q8_0.gguf", tensor_type="Q8_0")
    export_model(path, tmp_path / "out", progress=False)
    model = load_hf(_dequantized_hf(path, src, tmp_path / "dequantized"))[0]
    prompts = [_prompt(384, n, seed) for n, seed in ((12, 1), (30, 2), (21, 4), (45, 5))]
    want = [hf_greedy(model, p, 10) for p in prompts]
    assert llm_greedy(tmp_path / "out", prompts, 10, max_num_batched_tokens=24, block_size=8) == want


def test_bad_expert_metadata_is_a_model_format_error(hf_moe, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A file whose expert count or width disagrees with its tensors, or asks for absurd sizes, is refused with a
    ModelFormatError before anything is dequantized or allocated."""
    import octavo.export.gguf_writer as writer_module

    src = hf_moe("qwen3_moe")
    real = writer_module.write_moe_metadata
    for change, message in [
        (dict(expert_count=9), r"'model.layers.0.mlp.gate.weight' has shape \(8, 64\), the metadata implies \(9, 64\)"),
        (dict(expert_feed_forward_length=32), "experts.gate_proj.weight' has shape"),
        (dict(expert_count=100_000), "not a valid expert layout"),
        (dict(expert_used_count=20), "not a valid expert layout"),
    ]:
        def crafted(writer, config, change=change):  # noqa: ANN001, ANN202
            config = dict(config)
            config.update({"num_experts": change.get("expert_count", config.get("num_experts")),
                           "num_local_experts": change.get("expert_count", config.get("num_local_experts")),
                           "num_experts_per_tok": change.get("expert_used_count", config["num_experts_per_tok"]),
                           "moe_intermediate_size": change.get("expert_feed_forward_length",
                                                               config["moe_intermediate_size"])})
            real(writer, config)

        monkeypatch.setattr(writer_module, "write_moe_metadata", crafted)
        path = write_gguf(src, tmp_path / "bad.gguf")
        with pytest.raises(ModelFormatError, match=message):
            export_model(path, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()
        path.unlink()


def test_k_quant_experts_end_to_end(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Q4_K gate/up and Q6_K down experts (Q4_K_M's mix) in a qwen3moe file: gguf cannot quantize K types, so the
    experts are valid random K-quant blocks (tests/test_gguf_native.py's); the rest of the file is F32. The export
    keeps them in their blocks and matches transformers on the file's dequantized values."""
    import gguf
    from test_gguf_native import _raw_blocks

    import octavo.export.gguf_writer as writer_module

    src = make_random_model(tmp_path / "hf", "qwen3_moe", hidden_size=256, moe_intermediate_size=256,
                            intermediate_size=256, num_hidden_layers=2, mlp_only_layers=[])
    real = writer_module._add_tensor

    def k_quant_experts(writer, name: str, data: np.ndarray, qtype) -> None:  # noqa: ANN001
        if not name.endswith("_exps.weight"):
            return real(writer, name, data, qtype)
        kind = "Q6_K" if "down" in name else "Q4_K"
        experts, rows, k = data.shape
        raw = _raw_blocks(kind, experts * rows, k, seed=len(name) + int(name.split(".")[1]))
        writer.add_tensor(name, raw.reshape(experts, rows, -1), raw_dtype=gguf.GGMLQuantizationType[kind])

    monkeypatch.setattr(writer_module, "_add_tensor", k_quant_experts)
    path = write_gguf(src, tmp_path / "m.gguf")
    manifest = export_model(path, tmp_path / "out", progress=False)
    assert manifest.weights == "gguf" and manifest.moe["expert_weights"] == "gguf"
    node = _moe_nodes(tmp_path / "out")[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["gate_up_bits"], attrs["down_bits"]) == (4, 8)  # Q6_K's 6-bit codes ride in 8 bits
    reference = _dequantized_hf(path, src, tmp_path / "dequantized")
    ids = _prompt(manifest.vocab_size)
    want = hf_prompt_logits(reference, ids)
    # 1e-3: one position of this prompt amplifies float32 rounding (measured: transformers' float32 forward 1.2e-4 from
    # its float64 one there, octavo 6.6e-4); a wrong block, scale or expert is off by whole units
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), want, atol=1e-3, rtol=0)
