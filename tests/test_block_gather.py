"""octavo.BlockGather (plugins/onnxruntime/block_gather_op.cc): a GGUF's token embedding kept in the file's own
blocks and its rows dequantized on the fly, instead of a float32 copy in the export.

References: `gguf.quants.dequantize` (the gguf package's decoder, through test_gguf_native's `_reference`) for
every block type the exporter maps, bit for bit; an exported GGUF's embedding node against the same decoder
applied to the file's token_embd tensor.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from op_cases import one_node_session
from test_gguf_native import _raw_blocks, _reference

from octavo.export.block_layout import PanelWeights, panel_weights
from octavo.export.gguf_blocks import NATIVE_TYPES, parse_blocks, promote

_K = {t: (512 if t.endswith("_K") else 96) for t in NATIVE_TYPES}


def _session(pw: PanelWeights, **attrs: int) -> ort.InferenceSession:
    inits = [numpy_helper.from_array(pw.codes, "codes"), numpy_helper.from_array(pw.scales, "scales"),
             numpy_helper.from_array(pw.offsets, "offsets")]
    names = ["ids", "codes", "scales", "offsets"]
    if pw.scale_super is not None:
        inits += [numpy_helper.from_array(pw.scale_super, "scale_super"),
                  numpy_helper.from_array(pw.offset_super, "offset_super")]
        names += ["scale_super", "offset_super"]
    node = helper.make_node("BlockGather", names, ["y"], domain="octavo",
                            **{"K": pw.k, "N": pw.n, "bits": pw.bits, "block_size": pw.block_size, **attrs})
    return one_node_session(node, [("ids", TensorProto.INT64)], ["y"], inits)


def _same_values(got: np.ndarray, want: np.ndarray) -> None:
    """The same float32 values; a zero may carry the other sign (the op forms code * scale + offset in one fma:
    Q4_0's code 8 gives 8d - 8d = +0 where the gguf decoder's (8 - 8) * d is -0 for a negative d), which nothing
    downstream of an embedding can tell apart (norms square it, residual adds absorb it)."""
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.ascontiguousarray(want, np.float32))


@pytest.mark.parametrize("type_name", [*NATIVE_TYPES, "Q4_K+Q6_K"])
def test_rows_are_the_files_values(type_name: str) -> None:
    """Every row of every mapped type (K-quants in two-level scales, float16 / float32 scales otherwise, a fused
    Q4_K + Q6_K matrix promoted to 8-bit 16-blocks), N not a multiple of the 16-row panel, ids repeated and in
    any order, a 2-D ids tensor: the gguf decoder's float32 values, exactly."""
    k = 512 if "+" in type_name else _K[type_name]
    if "+" in type_name:
        raws = [(t, _raw_blocks(t, n, k, seed)) for t, n, seed in (("Q4_K", 21, 3), ("Q6_K", 16, 4))]
        blocks = promote([parse_blocks(t, raw, len(raw), k) for t, raw in raws])
        want = np.concatenate([_reference(t, raw, len(raw), k) for t, raw in raws])
    else:
        n = 37
        raw = _raw_blocks(type_name, n, k, 1)
        blocks, want = parse_blocks(type_name, raw, n, k), _reference(type_name, raw, n, k)
    pw = panel_weights(blocks)
    n = pw.n
    session = _session(pw)
    _same_values(session.run(None, {"ids": np.arange(n, dtype=np.int64)})[0], want)
    ids = np.random.default_rng(2).integers(0, n, (3, 11)).astype(np.int64)
    ids[0, 0], ids[1, 1], ids[2, 2] = n - 1, 0, n - 1
    _same_values(session.run(None, {"ids": ids})[0], want[ids])


def test_ids_outside_the_vocabulary_are_errors_naming_the_op() -> None:
    pw = panel_weights(parse_blocks("Q8_0", _raw_blocks("Q8_0", 24, 64, 5), 24, 64))
    session = _session(pw)
    for bad in (24, -1, 2**40):
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                           match=rf"octavo\.BlockGather: id {bad} is outside \[0, 24\) \(the vocabulary\)"):
            session.run(None, {"ids": np.array([3, bad], np.int64)})
    assert session.run(None, {"ids": np.zeros((0,), np.int64)})[0].shape == (0, 64)


def test_bad_attributes_and_shapes_are_clear_errors() -> None:
    pw = panel_weights(parse_blocks("Q4_0", _raw_blocks("Q4_0", 24, 96, 6), 24, 96))
    with pytest.raises(Exception, match=r"octavo\.BlockGather: bits must be 4 or 8, got 5"):
        _session(pw, bits=5)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"octavo\.BlockGather: codes must be uint8 \[2, 32, 16\], got \[2, 48, 16\]"):
        _session(pw, K=64).run(None, {"ids": np.array([1], np.int64)})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_exported_ggufs_embedding_is_gathered_from_its_blocks(hf_model_dir, tmp_path: Path, arch: str) -> None:  # noqa: ANN001
    """A quantized GGUF exports its embedding as BlockGather over the file's blocks, no float32 copy; a tied model's
    lm_head BlockMatMul reads the very same initializers (one copy of the blocks); the gathered rows are the gguf
    decoder's values of the file's token_embd, exactly."""
    import gguf

    from octavo.export import export_model
    from octavo.export.gguf_writer import write_gguf
    from octavo.export.manifest import Manifest

    path = write_gguf(hf_model_dir(arch), tmp_path / "m.Q4_0.gguf", tensor_type="Q4_0")
    out = tmp_path / "out"
    export_model(path, out, progress=False)
    manifest = Manifest.load(out)
    model = onnx.load(str(out / manifest.onnx_file))
    names = {t.name for t in model.graph.initializer}
    gathers = [n for n in model.graph.node if n.op_type == "BlockGather"]
    assert len(gathers) == 1 and gathers[0].input[0] == "input_ids"
    assert "model.embed_tokens.weight" not in names
    assert not [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] not in names - {"input_ids"}
                and n.input[1] == "input_ids"]
    head = [n for n in model.graph.node if n.op_type == "BlockMatMul" and "logits" in n.output[0]]
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    assert len(head) == 1 and (head[0].input[1] == gathers[0].input[1]) == tied

    embd = tensors["token_embd.weight"]
    hidden = {a.name: helper.get_attribute_value(a) for a in gathers[0].attribute}["K"]
    want = gguf.quants.dequantize(embd.data, embd.tensor_type).reshape(-1, hidden)
    values = {t.name: numpy_helper.to_array(t, base_dir=str(out)) for t in model.graph.initializer
              if t.name in gathers[0].input}
    session = one_node_session(gathers[0], [("input_ids", TensorProto.INT64)], [gathers[0].output[0]],
                               [numpy_helper.from_array(v, k) for k, v in values.items()])
    ids = np.arange(len(want), dtype=np.int64)
    _same_values(session.run(None, {"input_ids": ids})[0], want.astype(np.float32))
