"""Phi-3 / Phi-3.5 mini (`Phi3ForCausalLM`): what is specific to it, against transformers as the reference.

The checkpoint stores q/k/v fused (`self_attn.qkv_proj`) and gate/up fused (`mlp.gate_up_proj`); the
Checkpoint presents them as the separate tensors the graph builder reads (row-slice views). transformers
applies `sliding_window` on every layer (the test model's window, 16, is shorter than the prompts).
Tied and untied embeddings; GGUF files (llama.cpp arch "phi3": blk.N.attn_qkv, gate+up in blk.N.ffn_up,
q/k not permuted) through octavo's writer and reader. Longrope and partial rotary (Phi-3.5 128k, Phi-4-mini):
tests/test_longrope.py. The test models randomize their norm weights (tests/models.py).
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

from octavo.errors import ModelFormatError, UnsupportedArchitectureError
from octavo.export import export_model
from octavo.export.checkpoint import spec_from_config
from octavo.export.gguf_reader import read_gguf
from octavo.export.gguf_writer import write_gguf
from octavo.export.hf_reader import read_hf_folder
from octavo.export.manifest import Manifest

ATOL = 1e-4
PROMPT_LEN = 40  # longer than the phi3 test model's window of 16
WINDOW = 16


def _prompt(vocab_size: int, seed: int = 3, length: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, length).tolist()


def _windows(folder: Path) -> list[int]:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    return [next(a.i for a in n.attribute if a.name == "sliding_window") for n in nodes]


def _v4_layout(config: dict) -> dict:
    """CONFIG as Phi-3's released (transformers 4) config.json lays rope out: rope_theta at the top level,
    rope_scaling / partial_rotary_factor beside it, no rope_parameters (which would take precedence)."""
    params = config.pop("rope_parameters", None) or {}
    return {"rope_theta": params.get("rope_theta", 10000.0)} | config


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    """SRC copied to DST with CHANGES in its config.json (rope changes in the transformers 4 layout)."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    if {"rope_scaling", "partial_rotary_factor"} & changes.keys():
        config = _v4_layout(config)
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ----------------------------------------------------------------------------- fused tensors
def test_fused_tensors_are_presented_as_transformers_slices_them(hf_model_dir) -> None:  # noqa: ANN001
    """q/k/v and gate/up read from the checkpoint == the slices transformers' Phi3Attention / Phi3MLP take
    of the fused weights (query_pos = heads*head_dim, then kv; gate = first half), as views."""
    src = hf_model_dir("phi3")
    model = load_hf(src)[0]
    ckpt = read_hf_folder(src)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in ckpt.tensor_names)
    for layer, block in enumerate(model.model.layers):
        attn, p = block.self_attn, f"model.layers.{layer}."
        qkv = attn.qkv_proj.weight.detach().numpy()
        query_pos = model.config.num_attention_heads * attn.head_dim
        kv = attn.num_key_value_heads * attn.head_dim
        want = {"q_proj": qkv[:query_pos], "k_proj": qkv[query_pos:query_pos + kv], "v_proj": qkv[query_pos + kv:]}
        for name, rows in want.items():
            got = ckpt.tensor(p + f"self_attn.{name}.weight")
            np.testing.assert_array_equal(got, rows)
            assert isinstance(got.base, np.ndarray)  # a view of the mapped fused tensor, not a copy
        gate, up = block.mlp.gate_up_proj.weight.detach().numpy().reshape(2, -1, model.config.hidden_size)
        np.testing.assert_array_equal(ckpt.tensor(p + "mlp.gate_proj.weight"), gate)
        np.testing.assert_array_equal(ckpt.tensor(p + "mlp.up_proj.weight"), up)


def test_fused_rows_that_disagree_with_the_config_are_refused(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    src = _copy_with_config(hf_model_dir("phi3"), tmp_path / "bad", num_key_value_heads=3)
    ckpt = read_hf_folder(src)
    with pytest.raises(ModelFormatError, match="do not split into 3 parts"):
        ckpt.tensor("model.layers.0.self_attn.k_proj.weight")


# ----------------------------------------------------------------------------- logits and generation
@pytest.mark.parametrize("arch", ["phi3", "phi3tied"])
def test_logits_match_transformers(hf_model_dir, arch: str) -> None:  # noqa: ANN001
    src = hf_model_dir(arch)
    folder = exported(src)
    manifest = Manifest.load(folder)
    assert manifest.architecture == "phi3"
    assert manifest.tie_word_embeddings is (arch == "phi3tied")
    ids = _prompt(manifest.vocab_size)
    np.testing.assert_allclose(prefill_logits(folder, ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


def test_window_on_every_layer_as_transformers(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """transformers' Phi3 masks every layer with sliding_window; so does the graph. Without the window the
    logits past it differ from transformers' (so the logits tests do test the window)."""
    src = hf_model_dir("phi3")
    assert _windows(exported(src)) == [WINDOW, WINDOW]
    assert Manifest.load(exported(src)).sliding_window == WINDOW
    no_window = _copy_with_config(src, tmp_path / "hf", sliding_window=None)
    export_model(no_window, tmp_path / "out", progress=False)
    assert _windows(tmp_path / "out") == [0, 0]
    ids = _prompt(Manifest.load(tmp_path / "out").vocab_size)
    got, want = prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids)
    np.testing.assert_allclose(got[:WINDOW], want[:WINDOW], atol=ATOL, rtol=0)
    assert np.abs(got[WINDOW:] - want[WINDOW:]).max() > 1e-2


def test_engine_greedy_matches_transformers(hf_model_dir) -> None:  # noqa: ANN001
    """octavo.LLM (chunked prefill: 16-token steps, batched decode, prompts past the window) == HF greedy."""
    src = hf_model_dir("phi3")
    prompts = [_prompt(300, seed, 5 + 9 * seed) for seed in range(4)]  # 5..32 tokens; 32 + 12 > 2 windows
    got = llm_greedy(exported(src), prompts, 12, num_blocks=64, block_size=8, max_num_batched_tokens=16)
    for p, tokens in zip(prompts, got):
        assert tokens == hf_reference(src, p, 12)


# ----------------------------------------------------------------------------- released configs
# the published Phi-3-mini-4k-instruct config.json (transformers 4 layout), the fields octavo reads
PHI3_MINI_4K = dict(
    architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
    max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta=10000.0, rope_scaling=None, sliding_window=2047, hidden_act="silu", bos_token_id=1,
    eos_token_id=32000, pad_token_id=32000, tie_word_embeddings=False,
)


def test_phi3_mini_4k_config_as_transformers_reads_it() -> None:
    """Window 2047 on all 32 layers (transformers' Phi3 masks every layer when sliding_window is set),
    head_dim 96, no rope scaling; transformers' Phi3Config agrees on the rope it would use."""
    import transformers

    spec = spec_from_config(PHI3_MINI_4K)
    assert spec.architecture == "phi3" and spec.head_dim == 96 and spec.num_kv_heads == 32
    assert spec.sliding_windows == [2047] * 32 and spec.rope_scaling is None and not spec.tie_word_embeddings
    hf = transformers.Phi3Config(**PHI3_MINI_4K)
    assert hf.sliding_window == 2047 and hf.rope_parameters["rope_type"] == "default"
    assert hf.rope_parameters["rope_theta"] == spec.rope_theta


# ----------------------------------------------------------------------------- longrope: tests/test_longrope.py
def _config(hf_model_dir, **changes: object) -> dict:  # noqa: ANN001
    return json.loads((hf_model_dir("phi3") / "config.json").read_text()) | changes


# ----------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("arch", ["phi3", "phi3tied"])
def test_gguf_round_trip_logits_match_transformers(hf_model_dir, tmp_path: Path, arch: str) -> None:  # noqa: ANN001
    """HF -> octavo's GGUF writer (llama.cpp's phi3 layout) -> read_gguf -> export == transformers' logits.
    The file holds the fused tensors exactly as the HF ones (llama.cpp does not permute phi3's q/k), gate+up
    in ffn_up, no ffn_gate, the window in phi3.attention.sliding_window."""
    import gguf
    from safetensors.numpy import load_file

    src = hf_model_dir(arch)
    path = write_gguf(src, tmp_path / "model.gguf")
    raw = gguf.GGUFReader(path)
    names = {t.name: t for t in raw.tensors}
    weights = load_file(str(src / "model.safetensors"))
    assert not any(".ffn_gate." in n or ".attn_q." in n for n in names)
    for layer in range(2):
        np.testing.assert_array_equal(names[f"blk.{layer}.attn_qkv.weight"].data,
                                      weights[f"model.layers.{layer}.self_attn.qkv_proj.weight"])
        np.testing.assert_array_equal(names[f"blk.{layer}.ffn_up.weight"].data,
                                      weights[f"model.layers.{layer}.mlp.gate_up_proj.weight"])
    assert ("output.weight" in names) is (arch == "phi3")
    window = raw.fields["phi3.attention.sliding_window"].contents()
    assert window == (WINDOW if arch == "phi3" else 0)

    ckpt = read_gguf(path)
    assert ckpt.config["architectures"] == ["Phi3ForCausalLM"]
    assert "model.layers.1.mlp.gate_up_proj.weight" in ckpt.tensors
    manifest = export_model(path, tmp_path / "out", progress=False)
    assert manifest.architecture == "phi3" and manifest.tie_word_embeddings is (arch == "phi3tied")
    assert _windows(tmp_path / "out") == ([WINDOW, WINDOW] if arch == "phi3" else [0, 0])
    ids = _prompt(manifest.vocab_size)
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), hf_prompt_logits(src, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("weights,kernel", [("fp32", "block"), ("gguf", "block"), ("gguf", "matmulnbits")])
def test_q8_0_gguf_matches_transformers_on_the_dequantized_weights(hf_model_dir, tmp_path: Path,
                                                                 weights: str, kernel: str) -> None:  # noqa: ANN001
    """A Q8_0 phi3 GGUF (the fused attn_qkv / ffn_up quantized as one tensor each) exported == transformers'
    Phi3 with every weight replaced by gguf's own dequantization of the file's tensors (transformers then
    slices the fused ones itself)."""
    import gguf
    import torch

    src = hf_model_dir("phi3")
    path = write_gguf(src, tmp_path / "q8.gguf", tensor_type="Q8_0")
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert raw["blk.0.attn_qkv.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    model = load_hf(src)[0]
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = raw[_gguf_name(name)]
            values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            param.copy_(torch.from_numpy(np.array(values, np.float32).reshape(param.shape)))
    # fp32: dequantized to float32 Gemms; gguf (the default): the file's Q8_0 blocks (fused qkv / gate_up split
    # and re-stacked) multiplied by octavo.BlockMatMul (a prefill: float32 over the file's values), or by
    # MatMulNBits with float32 compute (accuracy_level 0) for the exactness check
    manifest = export_model(path, tmp_path / "out", progress=False, weights=weights, quant_kernel=kernel,
                            **({"accuracy_level": 0} if weights == "gguf" and kernel == "matmulnbits" else {}))
    assert manifest.weights == weights
    ops = {n.op_type for n in onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph.node}
    want_op = {"fp32": "Gemm", "block": "BlockMatMul", "matmulnbits": "MatMulNBits"}[kernel if weights == "gguf" else weights]
    assert want_op in ops and not {"Gemm", "BlockMatMul", "MatMulNBits"} - {want_op} & ops
    ids = _prompt(manifest.vocab_size)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), want, atol=ATOL, rtol=0)
    assert np.abs(want - hf_prompt_logits(src, ids)).max() > 1e-3  # Q8_0 did change the model


def _gguf_name(hf: str) -> str:
    from octavo.export.gguf_writer import gguf_tensor_name

    return gguf_tensor_name(hf)


def test_int8_export_equals_transformers_with_dequantized_weights(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """--weights int8 (accuracy_level 0: float compute) quantizes the presented q/k/v and gate/up slices;
    blockwise quantization runs along each row, so this equals transformers' Phi3 with its fused
    qkv_proj / gate_up_proj (and o/down) replaced by dequantize(quantize(W))."""
    import torch

    from octavo.export.quantize import dequantize, quantize

    src = hf_model_dir("phi3")
    export_model(src, tmp_path / "int8", progress=False, weights="int8", accuracy_level=0)
    model = load_hf(src)[0]
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                w = dequantize(quantize(module.weight.detach().numpy(), 8, 32))
                module.weight = torch.nn.Parameter(torch.from_numpy(w))
    ids = _prompt(Manifest.load(tmp_path / "int8").vocab_size)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = prefill_logits(tmp_path / "int8", ids)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, float(np.abs(want).max()))
    assert np.abs(want - hf_prompt_logits(src, ids)).max() > 1e-3  # int8 did change the model
