"""OnnxRuntimeBackend refuses a manifest that does not match the graph, and checks its arguments."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from engine_helpers import exported

from octavo.errors import ModelFormatError
from octavo.export.manifest import Manifest
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend


@pytest.fixture(scope="module")
def llama_export(hf_model_dir) -> tuple[Path, Manifest]:  # noqa: ANN001
    folder = exported(hf_model_dir("llama"))  # the session's export, only read here
    return folder, Manifest.load(folder)


def test_pools_have_the_manifest_shape(llama_export: tuple[Path, Manifest]) -> None:
    folder, manifest = llama_export
    backend = OnnxRuntimeBackend(folder, manifest, num_blocks=5, block_size=8, num_threads=1)
    assert len(backend.key_caches) == len(backend.value_caches) == manifest.num_layers
    assert backend.key_caches[0].shape == (5, 8, manifest.num_kv_heads, manifest.head_dim)
    assert backend.vocab_size == manifest.vocab_size
    backend.close()


@pytest.mark.parametrize("field,value,match", [
    ("num_layers", 3, "inputs do not match"),
    ("num_kv_heads", 4, "key_cache.0"),
    ("head_dim", 32, "key_cache.0"),
    ("vocab_size", 100, "logits"),
])
def test_mismatched_manifest(llama_export: tuple[Path, Manifest], field: str, value: int, match: str) -> None:
    folder, manifest = llama_export
    wrong = dataclasses.replace(manifest, **{field: value})
    with pytest.raises(ModelFormatError, match=match):
        OnnxRuntimeBackend(folder, wrong, num_blocks=4, block_size=4, num_threads=1)


def test_missing_onnx_file(llama_export: tuple[Path, Manifest], tmp_path: Path) -> None:
    _, manifest = llama_export
    with pytest.raises(ModelFormatError, match="missing"):
        OnnxRuntimeBackend(tmp_path, manifest, num_blocks=4, block_size=4, num_threads=1)


def test_bad_pool_size(llama_export: tuple[Path, Manifest]) -> None:
    folder, manifest = llama_export
    with pytest.raises(ValueError, match="positive"):
        OnnxRuntimeBackend(folder, manifest, num_blocks=0, block_size=4)


def test_spinning_modes_agree_and_a_typo_is_refused(llama_export: tuple[Path, Manifest],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """OCTAVO_ORT_SPINNING ("run" default, "0", "1") changes how ORT's threads wait, never the numbers;
    any other value is an error naming the choices, not a silent default."""
    import numpy as np

    from octavo.bench.roofline import _decode_inputs
    from octavo.errors import InvalidRequestError

    folder, manifest = llama_export
    logits = {}
    for mode in ("run", "0", "1"):
        monkeypatch.setenv("OCTAVO_ORT_SPINNING", mode)
        backend = OnnxRuntimeBackend(folder, manifest, num_blocks=8, block_size=8, num_threads=2)
        logits[mode] = np.array(backend.run(_decode_inputs(2, 5, 8)))
        backend.close()
    assert np.array_equal(logits["run"], logits["0"]) and np.array_equal(logits["run"], logits["1"])
    monkeypatch.setenv("OCTAVO_ORT_SPINNING", "yes")
    with pytest.raises(InvalidRequestError, match="OCTAVO_ORT_SPINNING.*'run'"):
        OnnxRuntimeBackend(folder, manifest, num_blocks=8, block_size=8, num_threads=2)
