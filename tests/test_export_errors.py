"""Bad checkpoints and folders get clear errors: unknown architecture, pickle (never unpickled), paths
escaping the model folder, truncated safetensors, a manifest from a newer octavo, an occupied OUT."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from octavo.cli import main as cli_main
from octavo.errors import ModelFormatError, UnsafePathError, UnsupportedArchitectureError
from octavo.export import export_model
from octavo.export.manifest import MANIFEST_NAME, Manifest
from octavo.export.resolve import resolve_model


@pytest.fixture()
def llama_copy(hf_model_dir, tmp_path: Path) -> Path:  # noqa: ANN001
    """A private copy of the tiny llama checkpoint that a test may damage."""
    return Path(shutil.copytree(hf_model_dir("llama"), tmp_path / "llama"))


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


class RunsCode:
    """Unpickling this touches a marker file: proof that a pickle was (wrongly) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.marker,))


def test_unknown_architecture_lists_supported(llama_copy: Path, tmp_path: Path) -> None:
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError) as info:
        export_model(llama_copy, tmp_path / "out", progress=False)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"))
    assert not (tmp_path / "out").exists()


def test_unsupported_rope_type(llama_copy: Path, tmp_path: Path) -> None:
    edit_config(llama_copy, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match="dynamic"):
        export_model(llama_copy, tmp_path / "out", progress=False)


def test_pickle_only_checkpoint_is_refused_unopened(llama_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "UNPICKLED"
    (llama_copy / "model.safetensors").unlink()
    (llama_copy / "pytorch_model.bin").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ModelFormatError, match="pickle") as info:
        export_model(llama_copy, tmp_path / "out", progress=False)
    assert "pytorch_model.bin" in str(info.value)
    with pytest.raises(ModelFormatError, match="pickle"):  # a pickle file given directly
        export_model(llama_copy / "pytorch_model.bin", tmp_path / "out", progress=False)
    assert not marker.exists(), "the pickle was loaded"
    pickle.loads((llama_copy / "pytorch_model.bin").read_bytes())  # the payload is live: this test can fail
    assert marker.exists()


def test_index_naming_a_pickle_is_refused(llama_copy: Path, tmp_path: Path) -> None:
    (llama_copy / "model.safetensors").rename(llama_copy / "weights.bin")
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "weights.bin"}}))
    with pytest.raises(ModelFormatError, match="pickle"):
        export_model(llama_copy, tmp_path / "out", progress=False)


@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_weights_index_escaping_the_folder(llama_copy: Path, tmp_path: Path, escape: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (llama_copy / "model.safetensors").rename(outside / "model.safetensors")
    target = "../outside/model.safetensors" if escape == "relative" else str(outside / "model.safetensors")
    (llama_copy / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": target}})
    )
    with pytest.raises(UnsafePathError, match="outside the model folder"):
        export_model(llama_copy, tmp_path / "out", progress=False)


def test_symlinked_weights_pointing_outside(llama_copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    (llama_copy / "model.safetensors").rename(outside)
    (llama_copy / "model.safetensors").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="symlink"):
        export_model(llama_copy, tmp_path / "out", progress=False)


def test_symlink_inside_the_folder_is_fine(llama_copy: Path, tmp_path: Path) -> None:
    (llama_copy / "model.safetensors").rename(llama_copy / "real.safetensors.data")
    (llama_copy / "model.safetensors").symlink_to("real.safetensors.data")
    assert export_model(llama_copy, tmp_path / "out", progress=False).num_layers == 2


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_safetensors(llama_copy: Path, tmp_path: Path, keep: float) -> None:
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else int(keep)])
    with pytest.raises(ModelFormatError, match="truncated"):
        export_model(llama_copy, tmp_path / "out", progress=False)


def test_newer_manifest_version(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    export_model(hf_model_dir("llama"), out, progress=False)
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["format_version"] += 1
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ModelFormatError, match="Upgrade octavo"):
        Manifest.load(out)
    with pytest.raises(ModelFormatError, match="Upgrade octavo"):
        resolve_model(out)


def test_occupied_output_folder(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ModelFormatError, match="not empty"):
        export_model(hf_model_dir("llama"), out, progress=False)
    with pytest.raises(ModelFormatError, match="not an octavo model folder"):  # --force never deletes other data
        export_model(hf_model_dir("llama"), out, progress=False, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "temporary folders left behind"


def test_cli_reports_errors_and_exports(hf_model_dir, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    missing = tmp_path / "nothing-here"
    assert cli_main(["export", str(missing), str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    out = tmp_path / "o"
    assert cli_main(["export", str(hf_model_dir("qwen2")), str(out), "--no-progress"]) == 0
    assert "exported qwen2" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == sorted(
        ["model.onnx", "model.onnx.data", MANIFEST_NAME, "tokenizer.json", "chat_template.jinja"]
    )
    assert cli_main(["export", str(hf_model_dir("qwen2")), str(out), "--no-progress", "--force"]) == 0


def test_cli_refuses_quantization_flags_that_change_nothing(hf_model_dir, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """`octavo export` with a flag its weight format ignores is a clear error (nothing written), not a silent
    no-op: --accuracy-level / --residual-rows on the default GGUF block kernel, --quant-kernel on fp32 weights,
    --quant-block-size on a GGUF's own blocks. The flags that do apply still export."""
    from octavo.commands import export as export_command
    from octavo.export import quantize
    from octavo.export.gguf_writer import write_gguf

    from octavo.commands.engine_flags import CHOICES

    assert (export_command.QUANT_KERNELS, export_command.RESIDUAL_ROWS) == (quantize.QUANT_KERNELS,
                                                                            quantize.RESIDUAL_ROWS)
    assert CHOICES["quant_kernel"] == quantize.QUANT_KERNELS  # serve/generate/... take the same choices
    gguf = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q8_0.gguf", tensor_type="Q8_0")
    hf = hf_model_dir("llama")
    refused = [
        ([gguf, "--accuracy-level", "0"], "--accuracy-level would change nothing for this export (weights gguf, "
                                          "kernel block)"),
        ([gguf, "--residual-rows", "0"], "--residual-rows would change nothing"),
        ([gguf, "--quant-kernel", "block", "--residual-rows", "8"], "--residual-rows would change nothing"),
        ([gguf, "--quant-block-size", "64", "--quantize-lm-head"], "--quant-block-size, --quantize-lm-head would"),
        ([hf, "--quant-kernel", "matmulnbits"], "--quant-kernel would change nothing for this export (weights fp32)"),
        ([hf, "--weights", "int4", "--residual-rows", "4"], "--residual-rows would change nothing"),
        ([hf, "--accuracy-level", "0"], "--accuracy-level would change nothing"),
    ]
    for argv, message in refused:
        assert cli_main(["export", str(argv[0]), str(tmp_path / "o"), "--no-progress", *argv[1:]]) == 2, argv
        assert message in capsys.readouterr().err, argv
        assert not (tmp_path / "o").exists()
    assert cli_main(["export", str(gguf), str(tmp_path / "mm"), "--no-progress", "--quant-kernel", "matmulnbits",
                     "--accuracy-level", "4", "--residual-rows", "8"]) == 0
    quantization = Manifest.load(tmp_path / "mm").quantization
    assert quantization["method"] == "MatMulNBits" and quantization["activation_residual_rows"] == 8  # type: ignore[index]
    assert cli_main(["export", str(gguf), str(tmp_path / "block"), "--no-progress", "--quant-kernel", "block"]) == 0
    assert Manifest.load(tmp_path / "block").quantization["method"] == "BlockMatMul"  # type: ignore[index]
