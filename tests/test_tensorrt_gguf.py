"""A GGUF exported on its own blocks (octavo.BlockMatMul, the default for a quantized .gguf) and TensorRT:
every way onto the TensorRT path refuses it with the reason and the way out (--weights fp32), before
anything TensorRT is imported, so the same error comes on a machine without TensorRT."""
from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
from engine_helpers import exported
from onnx import helper

from octavo.tensorrt.onnx_rewrite import prepare_onnx_for_tensorrt
from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.export import export_model
from octavo.export.gguf_writer import write_gguf
from octavo.runtime.engine_args import EngineArgs

WAY_OUT = "export with --weights fp32 (weights='fp32') for the TensorRT path"  # quant_options.not_on_tensorrt


@pytest.fixture(scope="module")
def block_export(hf_model_dir, tmp_path_factory) -> Path:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("trt_gguf")
    path = write_gguf(hf_model_dir("llama"), tmp / "m.Q4_0.gguf", tensor_type="Q4_0")
    manifest = export_model(path, tmp / "out", progress=False)
    assert manifest.quantization == {"method": "BlockMatMul", "source": "gguf", "lm_head": True}
    return tmp / "out"


def test_prepare_onnx_refuses_block_matmul(block_export: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match=r"\(octavo\.BlockMatMul\): quantized weights \(a GGUF's own blocks.*\) run on "
                                               r"ONNX Runtime only \(octavo\.BlockMatMul has no TensorRT plugin\); "
                                               + re.escape(WAY_OUT)):
        prepare_onnx_for_tensorrt(block_export / "model.onnx", tmp_path / "o.onnx")
    assert not (tmp_path / "o.onnx").exists()


def test_prepare_onnx_refuses_other_octavo_ops_but_not_paged_attention(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """PagedAttention (same domain) still maps to the plugin; any other op of the exporter's domain is refused."""
    fp32 = exported(hf_model_dir("llama"))
    assert prepare_onnx_for_tensorrt(fp32 / "model.onnx", tmp_path / "ok" / "o.onnx").is_file()
    model = onnx.load(str(fp32 / "model.onnx"), load_external_data=False)
    model.graph.node.append(helper.make_node("FoldRows", ["a", "b"], ["c"], name="fold", domain="octavo"))
    onnx.save(model, str(tmp_path / "extra.onnx"))
    with pytest.raises(ModelFormatError, match=r"octavo\.FoldRows is an ONNX Runtime custom op with no TensorRT "
                                               r"plugin; " + re.escape(WAY_OUT)):
        prepare_onnx_for_tensorrt(tmp_path / "extra.onnx", tmp_path / "o.onnx")


def test_build_refuses_a_gguf_block_export_before_tensorrt(block_export: Path, capsys) -> None:  # noqa: ANN001
    from octavo.tensorrt.builder import build_engine
    from octavo.cli import main

    with pytest.raises(ModelFormatError, match=r"holds gguf weights, which run on ONNX Runtime only \(octavo\.BlockMatMul has no "
                                                  r"TensorRT plugin\); " + re.escape(WAY_OUT)):
        build_engine(block_export)
    assert main(["build", str(block_export)]) == 2
    err = capsys.readouterr().err
    assert WAY_OUT in err and "TensorRT is not installed" not in err and "Traceback" not in err


def test_engine_refuses_gguf_weights_with_tensorrt(block_export: Path) -> None:
    from octavo.runtime.engine import LLMEngine

    for weights in ("gguf", "int8", "int4"):
        with pytest.raises(InvalidRequestError, match=fr"weights='{weights}': quantized weights run on ONNX Runtime only "
                                                      r"\(octavo\.BlockMatMul and MatMulNBits have no TensorRT plugin\); "
                                                      + re.escape(WAY_OUT)):
            EngineArgs(model="m.gguf", backend="tensorrt", weights=weights).validate()
    with pytest.raises(InvalidRequestError, match=r"gguf weights, which run on ONNX Runtime only \(octavo\.BlockMatMul has no "
                                                  r"TensorRT plugin\); " + re.escape(WAY_OUT)):
        LLMEngine(EngineArgs(model=str(block_export), backend="tensorrt"))


def test_build_exports_a_quantized_gguf_as_fp32(hf_model_dir, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`octavo build model.gguf` resolves the file the way the TensorRT backend does: dequantized to float32
    (a GGUF's own blocks would be refused); an export folder is taken as it is."""
    from octavo.commands.build import _resolve
    from octavo.export.manifest import Manifest

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q4_0.gguf", tensor_type="Q4_0")
    folder = _resolve(str(gguf))
    manifest = Manifest.load(folder)
    assert manifest.weights == "fp32" and manifest.quantization is None
    assert prepare_onnx_for_tensorrt(folder / manifest.onnx_file, tmp_path / "o.onnx").is_file()
    exported_folder = tmp_path / "export"
    export_model(gguf, exported_folder, progress=False)
    assert _resolve(str(exported_folder)) == exported_folder  # as it is: build_engine then refuses its blocks
