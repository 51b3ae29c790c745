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
    """ort_spinning ("run" default, "0", "1"; EngineArgs' default from OCTAVO_ORT_SPINNING) changes how ORT's
    threads wait, never the numbers; any other value is an error naming the choices, not a silent default."""
    import numpy as np

    from benchmarks.roofline import _decode_inputs
    from octavo.errors import InvalidRequestError
    from octavo.runtime.engine_args import EngineArgs

    folder, manifest = llama_export
    logits = {}
    for mode in ("run", "0", "1"):
        backend = OnnxRuntimeBackend(folder, manifest, num_blocks=8, block_size=8, num_threads=2, ort_spinning=mode)
        logits[mode] = np.array(backend.run(_decode_inputs(2, 5, 8)))
        backend.close()
    assert np.array_equal(logits["run"], logits["0"]) and np.array_equal(logits["run"], logits["1"])
    with pytest.raises(InvalidRequestError, match="ort_spinning.*'run'"):
        OnnxRuntimeBackend(folder, manifest, num_blocks=8, block_size=8, num_threads=2, ort_spinning="yes")
    monkeypatch.setenv("OCTAVO_ORT_SPINNING", "yes")
    with pytest.raises(InvalidRequestError, match="OCTAVO_ORT_SPINNING.*'run'"):
        EngineArgs(model=str(folder)).with_environment_defaults()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_logits_rows_from_the_buffer_and_from_ort_agree_and_are_the_callers(
        llama_export: tuple[Path, Manifest], kv_cache_dtype: str) -> None:
    """Steps of up to 64 logits rows write them into the backend's own buffer, larger ones into arrays ORT
    allocates: the same rows come out bit-identical either way, and an array a step returned is the caller's
    (the next step does not overwrite it)."""
    import numpy as np

    from benchmarks.roofline import _decode_inputs
    from octavo.runtime.backends.base import StepInputs

    folder, manifest = llama_export
    backend = OnnxRuntimeBackend(folder, manifest, num_blocks=32, block_size=8, num_threads=2,
                                 kv_cache_dtype=kv_cache_dtype)
    try:
        t = 70  # one prompt of 70 tokens, a logits row for each (as prompt logprobs ask)
        table = np.arange(9, dtype=np.int32).reshape(1, 9)

        def prefill(rows: int) -> np.ndarray:
            return backend.run(StepInputs(
                input_ids=np.arange(5, 5 + t, dtype=np.int64), position_ids=np.arange(t, dtype=np.int64),
                cumulative_sequence_length=np.array([0, t], np.int32), past_seqlens=np.zeros(1, np.int32),
                block_table=table, slot_mapping=np.arange(t, dtype=np.int64),
                logits_indices=np.arange(rows, dtype=np.int64)))

        everything, first64 = prefill(t), prefill(64)
        assert everything.shape == (t, manifest.vocab_size) and first64.shape == (64, manifest.vocab_size)
        np.testing.assert_array_equal(first64, everything[:64])
        kept = first64.copy()
        decoded = backend.run(_decode_inputs(2, 5, 8, first_block=12))
        assert decoded.shape == (2, manifest.vocab_size) and np.isfinite(decoded).all()
        np.testing.assert_array_equal(first64, kept)
        np.testing.assert_array_equal(prefill(t), everything)  # ORT's path again, after the buffer's: logits first
    finally:
        backend.close()
