"""The onnxruntime backend's knobs are EngineArgs fields (ort_fusions, ort_spinning, amx): set as `octavo.LLM`
keywords, engine flags or Triton parameters they reach the ONNX Runtime session and the op library, and their
environment variables (OCTAVO_ORT_FUSIONS, OCTAVO_ORT_SPINNING, OCTAVO_AMX) are the defaults of fields left unset,
read in one place (EngineArgs.with_environment_defaults)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from engine_helpers import exported
from step_inputs import one_sequence

from octavo.export.graph import STEP_INPUTS
from octavo.export.manifest import Manifest
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
from octavo.runtime.backends.oplib import library_path, set_amx
from octavo.runtime.backends.ort_fusions import fuse_rotary, fuse_rotary_into_attention
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.model_setup import make_backend

ENV = ("OCTAVO_ORT_FUSIONS", "OCTAVO_ORT_SPINNING", "OCTAVO_AMX")
TOKENS = [5, 9, 2, 7, 11, 3, 8, 4, 6, 1]


@pytest.fixture(scope="module")
def llama_export(hf_model_dir) -> tuple[Path, Manifest]:  # noqa: ANN001
    folder = exported(hf_model_dir("llama"))  # the session's export, only read here
    return folder, Manifest.load(folder)


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No knob from the caller's environment, and the process's AMX switch back on afterwards."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    set_amx(True)


def _knobs(args: EngineArgs) -> tuple[object, object, object]:
    return args.ort_fusions, args.ort_spinning, args.amx


def test_unset_fields_take_the_environment_and_set_fields_win() -> None:
    unset = EngineArgs(model="m")
    assert _knobs(unset) == (None, None, None)
    assert _knobs(unset.with_environment_defaults({})) == (True, "run", True)  # the built-in defaults
    off = {"OCTAVO_ORT_FUSIONS": "0", "OCTAVO_ORT_SPINNING": "1", "OCTAVO_AMX": "0"}
    assert _knobs(unset.with_environment_defaults(off)) == (False, "1", False)
    assert _knobs(unset.with_environment_defaults({"OCTAVO_ORT_FUSIONS": "yes", "OCTAVO_AMX": "1"})) == \
        (True, "run", True)  # only "0" turns them off, as before
    explicit = EngineArgs(model="m", ort_fusions=True, ort_spinning="0", amx=True)
    assert explicit.with_environment_defaults(off) == explicit


def test_os_environ_is_the_default_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCTAVO_ORT_FUSIONS", "0")
    monkeypatch.setenv("OCTAVO_ORT_SPINNING", "0")
    monkeypatch.setenv("OCTAVO_AMX", "0")
    assert _knobs(EngineArgs(model="m").with_environment_defaults()) == (False, "0", False)


def test_a_bad_spinning_mode_is_refused_by_name() -> None:
    from octavo.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="ort_spinning must be one of run, 0, 1"):
        EngineArgs(model="m", ort_spinning="always").validate()


def _spinning_entries(session: ort.InferenceSession) -> tuple[str, str | None]:
    options = session.get_session_options()
    try:
        stop = options.get_session_config_entry("session.force_spinning_stop")
    except RuntimeError:  # not set
        stop = None
    return options.get_session_config_entry("session.intra_op.allow_spinning"), stop


def _reference_logits(folder: Path, manifest: Manifest, fused: bool) -> np.ndarray:
    """The exported graph (rewritten by the fusion passes when FUSED) in a plain ONNX Runtime session: the prompt
    TOKENS from position 0 over empty pools, every logits row."""
    model = onnx.load(str(folder / manifest.onnx_file), load_external_data=False)
    if fused:
        assert fuse_rotary(model, manifest.max_context)
        fuse_rotary_into_attention(model)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library_path()))
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    step = one_sequence(TOKENS, 0, np.arange(1, dtype=np.int32), 16, all_logits=True)
    feeds = {name: getattr(step, name) for name, _, _ in STEP_INPUTS}
    shape = (1, 16, manifest.num_kv_heads, manifest.head_dim)
    for layer in range(manifest.num_layers):
        feeds[f"key_cache.{layer}"] = np.zeros(shape, np.float32)
        feeds[f"value_cache.{layer}"] = np.zeros(shape, np.float32)
    return session.run(["logits"], feeds)[0]


def _backend_logits(backend: OnnxRuntimeBackend) -> np.ndarray:
    return np.array(backend.run(one_sequence(TOKENS, 0, np.arange(1, dtype=np.int32), 16, all_logits=True)))


@pytest.mark.parametrize(("fusions", "spinning", "amx"), [(True, "run", True), (False, "0", False),
                                                          (True, "1", False)])
def test_each_field_reaches_the_session_and_the_op_library(llama_export: tuple[Path, Manifest], fusions: bool,
                                                            spinning: str, amx: bool) -> None:
    """make_backend (what LLM and the servers call) with the three fields set: the session's options hold the
    spinning mode, its graph is the fused one exactly when ort_fusions is on (its logits are a plain session's of
    that graph, bit for bit), and the op library's AMX switch is in the state asked for."""
    folder, manifest = llama_export
    set_amx(not amx)  # the backend must set it, whatever it was
    args = EngineArgs(model=str(folder), num_blocks=1, num_threads=1, ort_fusions=fusions, ort_spinning=spinning,
                      amx=amx)
    backend = make_backend(args, folder, manifest, manifest.max_context)
    try:
        assert set_amx(True) is amx  # the switch as the backend left it
        assert _spinning_entries(backend.session) == ("0" if spinning == "0" else "1",
                                                     "1" if spinning == "run" else None)
        got = _backend_logits(backend)
    finally:
        backend.close()
    np.testing.assert_array_equal(got, _reference_logits(folder, manifest, fusions))


def test_the_two_graphs_are_told_apart(llama_export: tuple[Path, Manifest]) -> None:
    """The check above can fail: the fused and the plain graph's logits differ in their last bits."""
    folder, manifest = llama_export
    fused, plain = _reference_logits(folder, manifest, True), _reference_logits(folder, manifest, False)
    np.testing.assert_allclose(fused, plain, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(fused, plain)


def test_the_environment_is_the_default_of_unset_fields(llama_export: tuple[Path, Manifest],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fields left unset: OCTAVO_ORT_FUSIONS=0, OCTAVO_ORT_SPINNING=0 and OCTAVO_AMX=0 reach the backend as the
    fields set to off would (read by load_model / make_backend through with_environment_defaults)."""
    folder, manifest = llama_export
    for name in ENV:
        monkeypatch.setenv(name, "0")
    backend = make_backend(EngineArgs(model=str(folder), num_blocks=1, num_threads=1), folder, manifest,
                           manifest.max_context)
    try:
        assert not backend.ort_fusions and set_amx(True) is False
        assert _spinning_entries(backend.session) == ("0", None)
        got = _backend_logits(backend)
    finally:
        backend.close()
    np.testing.assert_array_equal(got, _reference_logits(folder, manifest, False))


def test_llm_keywords_reach_the_backend(llama_export: tuple[Path, Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    """octavo.LLM(..., ort_fusions=..., ort_spinning=..., amx=...) as EngineArgs fields; a keyword wins over the
    environment."""
    from octavo import LLM

    folder, _ = llama_export
    monkeypatch.setenv("OCTAVO_ORT_SPINNING", "1")
    llm = LLM(str(folder), num_blocks=4, num_threads=1, ort_fusions=False, ort_spinning="0", amx=False)
    try:
        backend = llm.engine.backend
        assert isinstance(backend, OnnxRuntimeBackend) and not backend.ort_fusions
        assert _spinning_entries(backend.session) == ("0", None) and set_amx(True) is False
        assert llm.engine.args.ort_spinning == "0"
    finally:
        llm.engine.backend.close()


def test_flags_and_triton_parameters_carry_the_fields(llama_export: tuple[Path, Manifest], tmp_path: Path) -> None:
    """`octavo triton --no-ort-fusions --ort-spinning 0 --no-amx` writes the three as config.pbtxt parameters,
    which read back (as model_repo/octavo/1/model.py reads them) into the same fields."""
    from octavo.cli import main
    from octavo.triton_server.model_repository import _PARAM_RE, MODEL_NAME
    from octavo.serving.engine_params import engine_args_from_strings

    folder, _ = llama_export
    assert main(["triton", str(folder), "--repo-out", str(tmp_path), "--no-serve", "--no-ort-fusions",
                 "--ort-spinning", "0", "--no-amx"]) == 0
    config = (tmp_path / MODEL_NAME / "config.pbtxt").read_text()
    values = {m.group("key"): m.group("value") for m in _PARAM_RE.finditer(config)}
    assert {k: values[k] for k in ("ort_fusions", "ort_spinning", "amx")} == \
        {"ort_fusions": "false", "ort_spinning": "0", "amx": "false"}
    values.pop("model_path")
    assert _knobs(engine_args_from_strings(str(folder), values)) == (False, "0", False)
    assert _knobs(engine_args_from_strings(str(folder), {"ort_fusions": "", "amx": "none"})) == (None, None, None)
