"""A quantized GGUF run on its own blocks (weights="gguf", the default for such a file): octavo.export.gguf_blocks.

References: `gguf.quants.dequantize` (the gguf package's own decoder) for every block layout, value for value,
and transformers with every weight replaced by that dequantization for the exported graph's logits. The default
kernel is octavo.BlockMatMul (tests/test_block_matmul.py for the op itself): a prefill step multiplies the file's
float32 values in float32 (transformers' tolerance), a decode step of <= 3 rows rounds the activations to int16
per block (a looser, derived tolerance below). quant_kernel="matmulnbits" keeps ONNX Runtime's MatMulNBits: exact
at accuracy_level 0; its default accuracy_level 4 computes with int8 activations per block, as llama.cpp's own
kernels do, plus octavo.Int8Residual, and is checked for agreement instead.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_helpers import prefill_logits
from models import load_hf

from octavo.errors import InvalidRequestError
from octavo.export import export_model
from octavo.export.gguf_blocks import NATIVE_TYPES, Blocks, parse_blocks, promote
from octavo.export.gguf_writer import write_gguf

ATOL = 1e-4
# Decode steps (<= 8 rows) on BlockMatMul's 16-bit path round each activation to ~2^-16 of its block's max |x|
# (tests/test_block_matmul.py bounds the op), 256 times finer than MatMulNBits' int8 and as fine as int8 plus
# Int8Residual's int8 residual, which these deliberately chaotic models (any change of a weight or activation
# is amplified) turn into 2.2e-2 (Q8_0) / 3.5e-2 (Q4_1) on logits of ~13; measured on the 16-bit path, 40
# tokens: 9.1e-3 (llama Q4_0), 3.8e-2 (llama Q4_1), 1.9e-2 (qwen2 Q8_0), 3.0e-2 (tied Q4_1), about the same
# for steps of 1 and 8 rows. Plain int8 is 0.71 / 4.0 off, so 0.1 still fails an int8 rounding (or a wrong weight) by 7x+.
DECODE_ATOL = 0.1


def _raw_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A [n, bytes] GGUF tensor of TYPE_NAME: quantized by gguf.quants where it can, else random bytes
    (every byte pattern is a valid K-quant block) with finite fp16 super-block scales."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    per_block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    except NotImplementedError:
        raw = rng.integers(0, 256, (n * k // per_block, size), dtype=np.uint8)
        scale = rng.uniform(1e-3, 5e-2, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
        where = [208] if type_name == "Q6_K" else [0, 2]  # d (and dmin) of the super-block
        for i, at in enumerate(where):
            raw[:, at:at + 2] = scale[:, 2 * i:2 * i + 2]
        return raw.reshape(n, -1)


def _reference(type_name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    import gguf
    from gguf import quants

    return np.asarray(quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)), np.float32).reshape(n, k)


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_blocks_equal_gguf_dequantize(type_name: str) -> None:
    n, k = 7, 512
    raw = _raw_blocks(type_name, n, k)
    blocks = parse_blocks(type_name, raw, n, k)
    assert blocks is not None and blocks.bits in (4, 8) and int(blocks.codes.max()) < 2 ** blocks.bits
    np.testing.assert_array_equal(blocks.dequantize(), _reference(type_name, raw, n, k))
    # MatMulNBits' packed layout holds the same codes
    q = blocks.matmulnbits()
    assert q.packed.shape == (n, k // blocks.block_size, blocks.block_size * blocks.bits // 8)
    perm = np.random.default_rng(1).permutation(n)  # rows are independent (the q/k un-permutation relies on it)
    np.testing.assert_array_equal(blocks.rows(perm).dequantize(), _reference(type_name, raw, n, k)[perm])


@pytest.mark.parametrize("type_name", ["F16", "Q2_K", "Q3_K", "IQ4_NL"])
def test_types_without_an_exact_layout_are_left_float(type_name: str) -> None:
    assert parse_blocks(type_name, np.zeros((2, 64), np.uint8), 2, 256) is None


def test_header_type_ids_name_the_gguf_types() -> None:
    """quantized_linear_types reads type ids from the header without importing gguf: its table must agree."""
    import gguf

    from octavo.export.gguf_reader import FLOAT_TYPE_IDS, GGML_TYPE_NAMES, quantized_linear_types
    from test_gguf import SMOL

    assert all(gguf.GGMLQuantizationType(i).name == name for i, name in GGML_TYPE_NAMES.items())
    assert {gguf.GGMLQuantizationType(i).name for i in FLOAT_TYPE_IDS} == {"F32", "F16", "BF16"}
    assert quantized_linear_types(SMOL) == {"Q4_1": 210}  # SmolLM2's 30 layers x 7 projections


def test_parse_refuses_a_tensor_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="bytes"):
        parse_blocks("Q4_0", np.zeros((3, 17), np.uint8), 3, 64)


def test_promote_mixed_types_is_exact() -> None:
    """Q4_K_M stores some projections in Q6_K: a fused q/k/v of Q4_K + Q6_K + Q8_0 parts in one layout."""
    k = 256
    parts: list[Blocks] = []
    refs = []
    for i, (type_name, rows) in enumerate((("Q4_K", 4), ("Q6_K", 3), ("Q8_0", 2), ("Q4_0", 1))):
        raw = _raw_blocks(type_name, rows, k, seed=i)
        parts.append(parse_blocks(type_name, raw, rows, k))  # type: ignore[arg-type]
        refs.append(_reference(type_name, raw, rows, k))
    merged = promote(parts)
    assert (merged.bits, merged.block_size, merged.n) == (8, 16, 10)
    assert merged.types == ("Q4_K", "Q6_K", "Q8_0", "Q4_0")
    np.testing.assert_array_equal(merged.dequantize(), np.concatenate(refs))


def _with_gguf_weights(src: Path, path: Path):  # noqa: ANN202
    """transformers' model of SRC with every weight replaced by gguf's dequantization of the file's tensor."""
    import torch

    from octavo.export.gguf_reader import read_gguf

    model = load_hf(src)[0]
    tensors = read_gguf(path).tensors
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = "model.embed_tokens.weight" if name == "lm_head.weight" and name not in tensors else name
            param.copy_(torch.from_numpy(np.asarray(tensors[key])))
    return model


def _nodes(folder: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _stepped_logits(folder: Path, ids: list[int], rows: int, block_size: int = 16) -> np.ndarray:
    """The export's logits for every position of IDS, run as steps of ROWS tokens (decode-sized steps)."""
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from step_inputs import one_sequence

    blocks = -(-len(ids) // block_size)
    table = np.arange(blocks, dtype=np.int32)[::-1]
    backend = OnnxRuntimeBackend(folder, Manifest.load(folder), num_blocks=blocks, block_size=block_size, num_threads=1,
                                 kv_cache_dtype="float32")  # float32 pools: the blocks' exactness alone
    try:
        return np.concatenate([backend.run(one_sequence(ids[i:i + rows], i, table, block_size, all_logits=True))
                               for i in range(0, len(ids), rows)])
    finally:
        backend.close()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_decode_batch_gives_each_sequence_the_logits_it_gets_alone(hf_model_dir, tmp_path: Path,
                                                                    qtype: str) -> None:  # noqa: ANN001
    """12 sequences decoding one token each: a decode-only step past 8 rows, which the graph's decode_step flag
    sends to BlockMatMul's 16-bit tiles. Each sequence's logits are bit for bit those of its own one-row
    decode step (the 16-bit decode kernel); without the flag the step would be float32 and differ."""
    from step_inputs import StepInputs, one_sequence

    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    path = write_gguf(hf_model_dir("llama"), tmp_path / f"llama.{qtype}.gguf", tensor_type=qtype)
    export_model(path, tmp_path / "out", progress=False)
    flags = [n for n in onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph.node
             if "decode_step" in n.output]
    assert [n.op_type for n in flags] == ["Equal"]
    manifest = Manifest.load(tmp_path / "out")
    rng = np.random.default_rng(15)
    prompts = [rng.integers(0, manifest.vocab_size, int(rng.integers(3, 15))).tolist() for _ in range(12)]
    nexts = rng.integers(0, manifest.vocab_size, len(prompts)).tolist()
    backend = OnnxRuntimeBackend(tmp_path / "out", manifest, num_blocks=len(prompts), block_size=16,
                                 kv_cache_dtype="float32")
    try:
        for i, prompt in enumerate(prompts):  # sequence i in block i
            backend.run(one_sequence(prompt, 0, [i], 16))
        alone = np.concatenate([backend.run(one_sequence([t], len(p), [i], 16))
                                for i, (p, t) in enumerate(zip(prompts, nexts))])
        lens = np.array([len(p) for p in prompts], np.int32)
        blocks = np.arange(len(prompts), dtype=np.int32)
        together = backend.run(StepInputs(
            input_ids=np.array(nexts, np.int64), position_ids=lens.astype(np.int64),
            cumulative_sequence_length=np.arange(len(prompts) + 1, dtype=np.int32), past_seqlens=lens,
            block_table=blocks.reshape(-1, 1), slot_mapping=(blocks * 16 + lens).astype(np.int64),
            logits_indices=np.arange(len(prompts), dtype=np.int64)))
    finally:
        backend.close()
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("arch,qtype,kernel", [("llama", "Q4_0", "block"), ("llama", "Q4_1", "block"),
                                               ("qwen2", "Q8_0", "block"), ("tied", "Q4_1", "block"),
                                               ("llama", "Q4_1", "matmulnbits"), ("qwen2", "Q8_0", "matmulnbits")])
def test_native_export_equals_transformers_on_the_dequantized_weights(hf_model_dir, tmp_path: Path, arch: str,
                                                                       qtype: str, kernel: str) -> None:  # noqa: ANN001
    """The default for a quantized GGUF is its own blocks, multiplied by octavo.BlockMatMul: a prefill's logits
    are transformers' on the file's dequantized weights (the values are the file's; nothing is re-rounded), and
    decode-sized steps (1 and 8 rows: 16-bit activations) are within DECODE_ATOL. MatMulNBits at accuracy_level
    0 is exact too."""
    import torch
    from test_gguf import _with_random_biases

    src = hf_model_dir(arch)
    if arch == "qwen2":
        src = _with_random_biases(src, tmp_path / "biased")
    path = write_gguf(src, tmp_path / f"{arch}.{qtype}.gguf", tensor_type=qtype)
    manifest = export_model(path, tmp_path / "out", progress=False, quant_kernel=kernel,
                            **({"accuracy_level": 0} if kernel == "matmulnbits" else {}))  # float32 compute
    assert manifest.weights == "gguf"
    nodes = _nodes(tmp_path / "out")
    projections = 4 * manifest.num_layers + 1  # qkv, o, gate_up, down per layer, and lm_head
    with_mins = qtype == "Q4_1"  # Q4_1's per-block min
    if kernel == "block":
        assert manifest.quantization == {"method": "BlockMatMul", "source": "gguf", "lm_head": True}
        assert nodes["BlockMatMul"] == projections and not {"Gemm", "MatMul", "MatMulNBits"} & set(nodes)
    else:
        assert manifest.quantization == {"method": "MatMulNBits", "source": "gguf", "accuracy_level": 0,
                                         "lm_head": True, "activation_residual_rows": 0}
        assert nodes["MatMulNBits"] == projections and "Gemm" not in nodes and "BlockMatMul" not in nodes
        assert nodes.get("MatMul", 0) == (projections if with_mins else 0)  # one block-sum MatMul for the mins
    ids = np.random.default_rng(3).integers(0, manifest.vocab_size, 40).tolist()
    with torch.no_grad():
        want = _with_gguf_weights(src, path)(torch.tensor([ids])).logits[0].numpy()
    # MatMulNBits sums Q4_1's w = d*q + m as (x . d*q) + (block sums . m) (BlockMatMul's float32 path multiplies
    # the dequantized w): another float summation order, which these deliberately chaotic test models amplify
    # to ~1e-4 on logits of ~10 (1 element in 15,360)
    atol = 2 * ATOL if with_mins and kernel == "matmulnbits" else ATOL
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), want, atol=atol, rtol=0)
    if kernel == "block":
        for rows in (1, 8):
            got = _stepped_logits(tmp_path / "out", ids, rows)
            np.testing.assert_allclose(got, want, atol=DECODE_ATOL, rtol=0)
            top2 = np.sort(want, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 2 * DECODE_ATOL  # the greedy token wherever the error can't flip it
            assert clear.sum() >= len(ids) // 2 and (got.argmax(-1) == want.argmax(-1))[clear].all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_matmulnbits_int8_activations_with_the_residual_match_the_exact_path(hf_model_dir, tmp_path: Path,
                                                                            qtype: str) -> None:  # noqa: ANN001
    """quant_kernel="matmulnbits": accuracy_level 4 (its default) rounds activations to int8 per block, as
    llama.cpp does; it also multiplies what that rounding loses (octavo.Int8Residual / FoldRows), which brings
    the logits back to the exact path's: far closer than plain int8 (residual_rows=0), and every argmax equal."""
    from octavo.export.quantize import RESIDUAL_ROWS

    path = write_gguf(hf_model_dir("llama"), tmp_path / f"m.{qtype}.gguf", tensor_type=qtype)
    mm = {"progress": False, "quant_kernel": "matmulnbits"}
    export_model(path, tmp_path / "exact", accuracy_level=0, **mm)
    default = export_model(path, tmp_path / "default", **mm)
    export_model(path, tmp_path / "int8", residual_rows=0, **mm)
    assert default.quantization["accuracy_level"] == 4  # type: ignore[index]
    assert default.quantization["activation_residual_rows"] == RESIDUAL_ROWS  # type: ignore[index]
    nodes = _nodes(tmp_path / "default")
    assert nodes["Int8Residual"] == nodes["FoldRows"] == nodes["MatMulNBits"] == 4 * default.num_layers + 1
    assert "Int8Residual" not in _nodes(tmp_path / "int8")
    ids = np.random.default_rng(5).integers(0, 300, 48).tolist()
    exact = prefill_logits(tmp_path / "exact", ids)
    got = prefill_logits(tmp_path / "default", ids)
    plain = prefill_logits(tmp_path / "int8", ids)
    err, plain_err = np.abs(got - exact).max(), np.abs(plain - exact).max()
    assert err < plain_err / 20, (err, plain_err)  # measured ~100-300x closer
    # measured: Q8_0 2.2e-2 vs 7.1e-1, Q4_1 3.5e-2 vs 4.0 (logits up to ~13; these models amplify any error)
    assert (got.argmax(-1) == exact.argmax(-1)).all()
    if qtype != "Q8_0":  # Q4_1's block sums come from Int8Residual in one graph and ReduceSum in the other: a
        return           # last-bit difference that can move an int8 rounding downstream, so no equality there
    # a step longer than the residual's row limit runs plain int8 rows (and FoldRows passes them through)
    long_ids = np.random.default_rng(6).integers(0, 300, RESIDUAL_ROWS + 8).tolist()
    np.testing.assert_allclose(prefill_logits(tmp_path / "default", long_ids),
                               prefill_logits(tmp_path / "int8", long_ids), atol=1e-5, rtol=0)


def test_fp32_and_float_files_keep_float_weights(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    q4 = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q4_0.gguf", tensor_type="Q4_0")
    assert export_model(q4, tmp_path / "fp32", progress=False, weights="fp32").weights == "fp32"
    assert not {"MatMulNBits", "BlockMatMul"} & set(_nodes(tmp_path / "fp32"))
    f16 = write_gguf(hf_model_dir("llama"), tmp_path / "m.F16.gguf", tensor_type="F16")
    assert export_model(f16, tmp_path / "f16", progress=False).weights == "fp32"  # nothing quantized to keep
    with pytest.raises(InvalidRequestError, match="not a .gguf"):
        export_model(hf_model_dir("llama"), tmp_path / "hf", progress=False, weights="gguf")


def test_llm_defaults_to_the_files_blocks_and_caches_apart(hf_model_dir, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from octavo.export.manifest import Manifest
    from octavo.runtime.model_setup import resolve_model_dir

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q4_1.gguf", tensor_type="Q4_1")
    native = resolve_model_dir(path)
    assert "-gguf-block-" in native.name and Manifest.load(native).weights == "gguf"
    assert Manifest.load(native).quantization == {"method": "BlockMatMul", "source": "gguf", "lm_head": True}
    assert resolve_model_dir(path, "gguf") == native
    fp32 = resolve_model_dir(path, "fp32")
    assert fp32 != native and Manifest.load(fp32).weights == "fp32"
    with pytest.raises(InvalidRequestError, match="weights='gguf'"):
        from octavo.runtime.engine_args import EngineArgs

        EngineArgs(model=str(path), weights="gguf", backend="tensorrt").validate()


def test_llm_quant_kernel_matches_octavo_export_and_caches_apart(hf_model_dir, tmp_path: Path, monkeypatch,
                                                                 capsys) -> None:  # noqa: ANN001
    """LLM(gguf, quant_kernel="matmulnbits") exports the MatMulNBits variant into its own cache folder and generates
    what the same export made by `octavo export --quant-kernel matmulnbits` does (greedy text and tokens, through
    `octavo generate --quant-kernel` too); an export folder must match the kernel asked for; bad values and a
    kernel for float weights are refused with the choices / the rule `octavo export` applies."""
    from octavo import LLM, SamplingParams
    from octavo.cli import main as cli_main
    from octavo.errors import ExportMismatchError, ModelFormatError
    from octavo.export.manifest import Manifest

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q8_0.gguf", tensor_type="Q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = "The quick brown fox"

    mm = LLM(str(path), quant_kernel="matmulnbits", num_threads=1, num_blocks=16)
    mm_dir = mm.engine.model_dir
    assert mm_dir.parent == tmp_path / "cache" and "-gguf-a4-r64-" in mm_dir.name
    assert Manifest.load(mm_dir).quantization["method"] == "MatMulNBits"  # type: ignore[index]
    assert "MatMulNBits" in _nodes(mm_dir) and "BlockMatMul" not in _nodes(mm_dir)
    got = mm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    assert cli_main(["export", str(path), str(tmp_path / "cli"), "--no-progress", "--quant-kernel", "matmulnbits"]) == 0
    assert Manifest.load(tmp_path / "cli").quantization == Manifest.load(mm_dir).quantization
    want = LLM(str(tmp_path / "cli"), num_threads=1, num_blocks=16).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, list(got.token_ids)) == (want.text, list(want.token_ids))

    block_dir = LLM(str(path), num_threads=1, num_blocks=16).engine.model_dir  # the default kernel: another folder
    assert block_dir != mm_dir and "-gguf-block-" in block_dir.name
    assert LLM(str(path), quant_kernel="block", num_threads=1, num_blocks=16).engine.model_dir == block_dir
    assert LLM(str(path), quant_kernel="matmulnbits", num_threads=1, num_blocks=16).engine.model_dir == mm_dir  # cached
    capsys.readouterr()
    assert cli_main(["generate", str(path), prompt, "--quant-kernel", "matmulnbits", "--max-tokens", "12",
                     "--ignore-eos", "--num-blocks", "16", "--num-threads", "1"]) == 0
    assert capsys.readouterr().out == want.text + "\n"

    # an export folder holds one kernel: the same is accepted, the other refused (both error kinds match)
    assert LLM(str(mm_dir), quant_kernel="matmulnbits", num_threads=1, num_blocks=16).engine.model_dir == mm_dir
    for error in (ExportMismatchError, InvalidRequestError, ModelFormatError):
        with pytest.raises(error, match="with MatMulNBits, not BlockMatMul .*--quant-kernel block"):
            LLM(str(mm_dir), quant_kernel="block")
    with pytest.raises(InvalidRequestError, match="with BlockMatMul, not MatMulNBits"):
        LLM(str(block_dir), quant_kernel="matmulnbits")
    with pytest.raises(InvalidRequestError, match="'block', 'block-bf16', 'matmulnbits'"):
        LLM(str(path), quant_kernel="fast")
    with pytest.raises(SystemExit) as refused:  # argparse: the usage line and the choices, exit status 2
        cli_main(["generate", str(path), prompt, "--quant-kernel", "fast"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "invalid choice: 'fast'" in err and "block" in err and "matmulnbits" in err
    fp32 = LLM(str(path), weights="fp32", num_threads=1, num_blocks=16).engine.model_dir
    for model, kwargs in ((path, {"weights": "fp32"}), (hf_model_dir("llama"), {}), (fp32, {})):
        with pytest.raises(InvalidRequestError, match=r"quant_kernel would change nothing .*\(weights fp32\)"):
            LLM(str(model), quant_kernel="matmulnbits", **kwargs)
    with pytest.raises(InvalidRequestError, match="tensorrt runs float weights only"):
        LLM(str(path), quant_kernel="matmulnbits", backend="tensorrt")


def test_an_export_newer_than_the_op_library_says_to_rebuild_it(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """An op the built library lacks (an export made by newer sources, e.g. after `git pull` without `make op`)
    is an OpLibraryError naming the op and the fix, not ONNX Runtime's bare 'not a registered function/op'."""
    from octavo.errors import OpLibraryError
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    path = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q8_0.gguf", tensor_type="Q8_0")
    out = tmp_path / "out"
    export_model(path, out, progress=False)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    next(n for n in model.graph.node if n.op_type == "BlockMatMul").op_type = "BlockMatMulFromTheFuture"
    onnx.save(model, str(out / "model.onnx"))
    with pytest.raises(OpLibraryError, match=r"octavo\.BlockMatMulFromTheFuture.*make op"):
        OnnxRuntimeBackend(out, Manifest.load(out), num_blocks=4, block_size=16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_fused_projection_of_two_types_runs_one_node_per_type(hf_model_dir, tmp_path: Path, arch: str) -> None:  # noqa: ANN001
    """llama.cpp's Q4_K_M keeps attn_v of some layers in Q6_K beside Q4_K q and k; here Q4_0 q/k beside a Q8_0 v
    (qwen2: with q/k/v biases). The fused q/k/v runs as one 4-bit BlockMatMul writing q and k and one 8-bit one
    writing v, instead of one node with q and k promoted to v's 8-bit codes; the prefill's logits are still
    transformers' on the file's dequantized weights."""
    import torch
    from test_gguf import _with_random_biases

    src = hf_model_dir(arch)
    if arch == "qwen2":
        src = _with_random_biases(src, tmp_path / "biased")
    path = write_gguf(src, tmp_path / f"{arch}.mixed.gguf", tensor_type="Q4_0", tensor_types={"attn_v.weight": "Q8_0"})
    manifest = export_model(path, tmp_path / "out", progress=False)
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    qkv = [n for n in graph.node if n.op_type == "BlockMatMul" and ".qkv_proj." in n.input[1]]
    bits = sorted((_attr(n, "bits"), len(n.output)) for n in qkv)
    assert bits == [(4, 2)] * manifest.num_layers + [(8, 1)] * manifest.num_layers
    assert not [n for n in graph.node if n.op_type == "Split" and any(".qkv_proj." in i for i in n.input)]
    ids = np.random.default_rng(4).integers(0, manifest.vocab_size, 40).tolist()
    with torch.no_grad():
        want = _with_gguf_weights(src, path)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(prefill_logits(tmp_path / "out", ids), want, atol=ATOL, rtol=0)


def _attr(node: onnx.NodeProto, name: str) -> int:
    """The int attribute NAME of NODE."""
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)
