"""octavo's TensorRT builder, plugin and backend end to end on CPU, against a stand-in for TensorRT and
cuda-python (tests/tensorrt_standin, README there) that enforces TensorRT 11's / 10's rules.

`octavo.tensorrt.builder.build_engine` runs unchanged: the real plugin module registers through
the stand-in `tensorrt.plugin` (signatures validated), the parser creates the plugin from the node's
attributes as onnx-tensorrt does, the builder calls the plugin's `aot_impl` (the Triton kernel is really
compiled to PTX for sm_90) and checks strong typing, the preview feature and the aliased network
outputs; `TensorRTBackend` then runs a prefill and a decode step whose logits must match transformers:
the decode step is only right if the first step's K/V landed in the backend's pools in place.

The stand-in does not report the aliasing through `get_aliased_input_tensor` unless asked (TensorRT does not
promise to): the backend must run an engine whose report is empty, and refuse one that really does not write
the pools in place (its start-up probe step reads them back).

Each scenario runs in a subprocess whose sys.path starts with the stand-in, so this pytest process never
sees a `tensorrt` module (other tests skip on `find_spec("tensorrt")`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

TESTS = Path(__file__).parent
ROOT = TESTS.parent
STANDIN = TESTS / "tensorrt_standin"
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 1, 30, 77, 120, 9, 14, 200, 6]  # 18 tokens: crosses a block


def _steps(backend, prompt: list[int]):  # noqa: ANN001, ANN202
    from octavo.runtime.backends.base import StepInputs

    table = np.array([[3, 9]], np.int32)  # shuffled physical blocks
    slots = lambda ps: np.array([table[0, p // 16] * 16 + p % 16 for p in ps], np.int64)  # noqa: E731
    n = len(prompt)
    got1 = backend.run(StepInputs(np.array(prompt, np.int64), np.arange(n, dtype=np.int64), np.array([0, n], np.int32),
                                  np.array([0], np.int32), table, slots(range(n)), np.array([n - 1], np.int64)))
    nxt = int(got1[0].argmax())
    got2 = backend.run(StepInputs(np.array([nxt], np.int64), np.array([n], np.int64), np.array([0, 1], np.int32),
                                  np.array([n], np.int32), table, slots([n]), np.array([0], np.int64)))
    return got1, got2, nxt


def _worker(scenario: str, folder: str) -> None:
    """Inside the stand-in subprocess: one scenario, one JSON line."""
    import tensorrt as trt

    from octavo.tensorrt import builder as tb
    from octavo.errors import OctavoError
    from octavo.export.manifest import Manifest
    from octavo.tensorrt.backend import TensorRTBackend

    folder_path = Path(folder)
    manifest = Manifest.load(folder_path)
    result: dict = {"scenario": scenario, "tensorrt": trt.__version__}
    options = tb.TensorRTBuildOptions(dtype="float32", max_num_tokens=64, max_num_seqs=4, max_num_blocks=64)
    try:
        if scenario.startswith("run_"):
            options.dtype = scenario.removeprefix("run_")
            tb.build_engine(folder_path, options)
            spec = json.loads((folder_path / f"model.{options.dtype}.engine").read_bytes())
            result["aliases"] = spec["aliases"]
            result["kernel"] = {k: v for k, v in spec["kernels"][0].items() if k != "extras"}
            result["kernel"]["params"] = {k: repr(v) for k, v in spec["kernels"][0]["params"].items()}
            backend = TensorRTBackend(folder_path, manifest, num_blocks=16)
            got1, got2, nxt = _steps(backend, PROMPT)
            result.update(reported=backend.aliasing_reported, in_place_verified=backend.in_place_verified,
                          device_memory=backend.device_memory_bytes,
                          build_info=json.loads((folder_path / "tensorrt.json").read_text()))
            result.update(logits1=got1[0].tolist(), logits2=got2[0].tolist(), next=nxt,
                          pool_written=bool(np.count_nonzero(backend.read_pool("key_cache.0"))),
                          pool_offsets=sorted(p - min(backend.pool_pointers.values()) for p in backend.pool_pointers.values()))
            backend.close()
        elif scenario == "build_bfloat16":
            # bf16 through the builder (typed graph, bf16 plugin variant compiled) and loaded (the probe step runs)
            options.dtype = "bfloat16"
            tb.build_engine(folder_path, options)
            spec = json.loads((folder_path / "model.bfloat16.engine").read_bytes())
            result["aliases"] = spec["aliases"]
            result["kernel_name"] = spec["kernels"][0]["name"]
            result["pool_types"] = sorted({t for n, t, _ in spec["inputs"] if n.startswith("key_cache.")})
            backend = TensorRTBackend(folder_path, manifest, num_blocks=16)
            result["pool_view"] = str(backend.read_pool("key_cache.0").dtype)
            backend.close()
        elif scenario == "copies_default_pool":
            # TensorRT copies around the plugin; the profile sized from the (stand-in) GPU's free memory: the
            # engine's own memory holds a real layer's pools, and the build refuses it
            options.max_num_blocks = None
            tb.build_engine(folder_path, options)
        elif scenario == "copies_output_bound_elsewhere":
            # mutation: with copies inserted, an output bound to its own buffer leaves the pool stale; the probe
            # step must see it (the stand-in then cannot refuse the binding itself)
            tb.build_engine(folder_path, options)
            original = TensorRTBackend._bind

            def bind_elsewhere(self, name, ptr):  # noqa: ANN001, ANN202
                return original(self, name, self._malloc(1 << 20) if name.endswith(".out") else ptr)

            TensorRTBackend._bind = bind_elsewhere
            TensorRTBackend(folder_path, manifest, num_blocks=16)
        elif scenario == "ptx_with_scratch_params":
            # mutation: hand TensorRT Triton's PTX as compiled (17 parameters for a 15-argument launch)
            import octavo.tensorrt.ptx_abi as ptx_abi

            ptx_abi.plugin_ptx = lambda ptx, name: ptx
            tb.build_engine(folder_path, options)
        elif scenario == "no_preview_feature":
            # mutation: the builder forgets the preview feature -> the engine does not alias the pools,
            # and the backend refuses it instead of decoding from a stale cache
            tb.configure_builder = lambda trt, config, workspace, dtype="float16": None
            tb.build_engine(folder_path, options)
            TensorRTBackend(folder_path, manifest, num_blocks=16)
        elif scenario == "flags":
            network = trt.Builder(trt.Logger()).create_network(tb.network_flags(trt))
            config = trt.Builder(trt.Logger()).create_builder_config()
            tb.configure_builder(trt, config, 1 << 20)
            fp32 = trt.Builder(trt.Logger()).create_builder_config()
            tb.configure_builder(trt, fp32, 1 << 20, "float32")
            result["tf32"] = {"float16": trt.BuilderFlag.TF32 in config.flags, "float32": trt.BuilderFlag.TF32 in fp32.flags}
            result["network_flags"] = network.flags
            result["strongly_typed_bit"] = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
            result["preview"] = sorted(f.name for f in config.preview)
        elif scenario == "fp16_flag":
            config = trt.Builder(trt.Logger()).create_builder_config()
            config.set_flag(trt.BuilderFlag.FP16)  # what the old builder did
        elif scenario == "old_tensorrt_new_numpy":
            tb.build_engine(folder_path, options)
        elif scenario == "old_tensorrt_new_numpy_unchecked":
            tb.check_tensorrt_numpy = lambda *args: None
            tb.build_engine(folder_path, options)
        result["status"] = "ok"
    except (OctavoError, AttributeError, TypeError, ValueError) as exc:
        result.update(status="error", type=type(exc).__name__, error=str(exc))
    result["trt_errors"] = list(trt.ERRORS)
    print(json.dumps(result), flush=True)


def _run(scenario: str, folder: Path, version: str = "11.4.0.106", **standin_env: str) -> dict:
    env = dict(os.environ, OCTAVO_TRT_STANDIN_VERSION=version, **standin_env)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import test_tensorrt_standin as t; t._worker({scenario!r}, {str(folder)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, hf_model_dir):  # noqa: ANN001, ANN201
    """Factory: a fresh export folder of the tiny llama per call (engines are written into it)."""
    export = pytest.importorskip("octavo.export.exporter")

    def make() -> Path:
        folder = tmp_path_factory.mktemp("trt_standin") / "model"
        export.export_model(hf_model_dir("llama"), folder, progress=False)
        return folder

    return make


@pytest.fixture(scope="module")
def reference(hf_model_dir):  # noqa: ANN001, ANN201
    import torch

    from models import load_hf

    model, _ = load_hf(hf_model_dir("llama"))

    def logits(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].numpy()

    return logits


@pytest.mark.parametrize(("dtype", "atol", "standin"), [
    ("float32", 1e-3, {}),  # TensorRT aliases the pools but does not report it
    ("float16", 1.5e-1, {"OCTAVO_TRT_STANDIN_ALIAS_REPORT": "exact"}),  # fp16: weights and GEMMs in fp16
    ("float32", 1e-3, {"OCTAVO_TRT_STANDIN_ALIAS_COPIES": "1"}),  # copies around the plugin, output bound = input
    ("bfloat16", 6e-1, {}),  # bf16 (8-bit mantissa): ~8x fp16's error; the plugin computed on float32 copies
])
def test_build_and_run_through_tensorrt_standin_matches_transformers(exported, reference, dtype: str,  # noqa: ANN001
                                                                     atol: float, standin: dict) -> None:
    from octavo.export.manifest import Manifest

    folder = exported()
    layers = Manifest.load(folder).num_layers
    result = _run(f"run_{dtype}", folder, **standin)
    assert result["status"] == "ok", result
    assert not result["trt_errors"], result["trt_errors"]
    # every pool output is a network output aliased to its pool input (so the plugin writes in place)
    pools = {f"{kind}.{layer}.out": f"{kind}.{layer}" for layer in range(layers) for kind in ("key_cache", "value_cache")}
    assert result["aliases"] == pools
    # what TensorRT reported is recorded, not required; the probe step proved the in-place write
    assert result["reported"] == (pools if standin.get("OCTAVO_TRT_STANDIN_ALIAS_REPORT") == "exact"
                                  else dict.fromkeys(pools))
    assert result["in_place_verified"] is True
    # the PTX TensorRT gets declares exactly the 15 parameters its AOT launch passes
    assert result["kernel"]["ptx_params"] == 15, result["kernel"]
    info = result["build_info"]
    assert info["max_num_blocks"] == 64 and info["device_memory_bytes"] == result["device_memory"] > 0
    assert info["kv_pool_bytes_per_layer"] == 2 * 64 * 16 * 2 * 16 * (4 if dtype == "float32" else 2)
    assert all(offset % 256 == 0 for offset in result["pool_offsets"]), result["pool_offsets"]
    assert result["pool_written"]
    kernel = result["kernel"]
    assert kernel["ptx_chars"] > 1000 and kernel["name"].startswith("_paged_attention_kernel")
    ref = reference(PROMPT + [result["next"]])
    n = len(PROMPT)
    np.testing.assert_allclose(result["logits1"], ref[n - 1], atol=atol, rtol=0)
    np.testing.assert_allclose(result["logits2"], ref[n], atol=atol, rtol=0)  # needs step 1's K/V in the pool
    assert result["next"] == int(ref[n - 1].argmax())


def test_bfloat16_engine_builds_with_typed_pools_and_aliasing(exported) -> None:  # noqa: ANN001
    result = _run("build_bfloat16", exported())
    assert result["status"] == "ok", result
    assert result["pool_types"] == ["bfloat16"] and len(result["aliases"]) >= 4
    assert result["kernel_name"].startswith("_paged_attention_kernel")
    assert result["pool_view"] == "uint16"  # bf16 pools come back as raw bits


@pytest.mark.parametrize("version", ["11.4.0.106", "10.16.1.11"])
def test_builder_flags_strongly_typed_and_aliasing_preview(exported, version: str) -> None:  # noqa: ANN001
    """TensorRT 10: STRONGLY_TYPED asked for explicitly; 11: always strongly typed, no flag (deprecated).
    Both: ALIASED_PLUGIN_IO_10_03 on."""
    result = _run("flags", exported(), version)
    assert result["status"] == "ok", result
    expected = result["strongly_typed_bit"] if version.startswith("10.") else 0
    assert result["network_flags"] == expected
    assert result["preview"] == ["ALIASED_PLUGIN_IO_10_03"]
    assert result["tf32"] == {"float16": True, "float32": False}  # fp32 engines compute in IEEE fp32


def test_standin_drops_aliasing_without_preview_feature_and_backend_refuses(exported) -> None:  # noqa: ANN001
    """Mutation: no preview feature -> the engine writes K/V to its own buffers; the probe step sees the stale
    pools (the stand-in reports aliasing exactly here, so only the probe can catch it)."""
    result = _run("no_preview_feature", exported(), OCTAVO_TRT_STANDIN_ALIAS_REPORT="exact")
    assert result["status"] == "error" and result["type"] == "ModelFormatError", result
    assert "did not write the KV pools in place (4 of 4 pools unchanged, e.g. 'key_cache.0'" in result["error"]
    assert "TensorRT reported 0 aliased pool outputs" in result["error"]


def test_output_bound_elsewhere_under_copies_is_caught_by_the_probe(exported) -> None:  # noqa: ANN001
    result = _run("copies_output_bound_elsewhere", exported(), OCTAVO_TRT_STANDIN_ALIAS_COPIES="1")
    assert result["status"] == "error" and result["type"] == "ModelFormatError", result
    assert "did not write the KV pools in place" in result["error"]


def test_engine_copying_a_real_pool_is_refused_at_build(exported) -> None:  # noqa: ANN001
    """The profile's pool rows default to what fits on the GPU (the stand-in's 1 GiB); an engine that copies
    around the plugin then reserves a real layer's pools, which the build reports instead of shipping."""
    result = _run("copies_default_pool", exported(), OCTAVO_TRT_STANDIN_ALIAS_COPIES="1")
    assert result["status"] == "error" and result["type"] == "EngineBuildError", result
    assert "TensorRT copies the pools around the in-place attention plugin" in result["error"]


def test_ptx_with_triton_scratch_parameters_is_refused(exported) -> None:  # noqa: ANN001
    """Mutation: without ptx_abi.plugin_ptx the PTX declares 17 parameters for TensorRT's 15 arguments."""
    result = _run("ptx_with_scratch_params", exported())
    assert result["status"] == "error" and result["type"] == "EngineBuildError", result
    assert any("declares 17 parameters; the AOT launch passes 15" in e for e in result["trt_errors"]), result


def test_tensorrt_11_has_no_fp16_builder_flag(exported) -> None:  # noqa: ANN001
    """The stand-in is faithful to 11.4 here: the old builder's set_flag(BuilderFlag.FP16) fails."""
    result = _run("fp16_flag", exported())
    assert result["status"] == "error" and result["type"] == "AttributeError", result
    assert _run("fp16_flag", exported(), version="10.16.1.11")["status"] == "ok"


def test_old_tensorrt_with_numpy_2_4_is_refused_with_the_fix(exported) -> None:  # noqa: ANN001
    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4):
        pytest.skip("numpy < 2.4: TensorRT < 11.3 reads plugin attributes fine")
    result = _run("old_tensorrt_new_numpy", exported(), version="11.2.1.2")
    assert result["status"] == "error" and result["type"] == "BackendUnavailableError", result
    assert "pip install 'tensorrt>=11.3' or 'numpy<2.4'" in result["error"]
    # without the check, the parser's plugin creation fails exactly as tensorrt.plugin 11.2 does
    unchecked = _run("old_tensorrt_new_numpy_unchecked", exported(), version="11.2.1.2")
    assert unchecked["status"] == "error", unchecked
    assert "only 0-dimensional arrays can be converted to Python scalars" in unchecked["error"]
