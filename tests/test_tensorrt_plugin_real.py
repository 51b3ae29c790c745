"""octavo's plugin module against the REAL `tensorrt.plugin` Python from a TensorRT bindings wheel.

`tensorrt.plugin` is pure Python over the native `tensorrt` module, which needs libnvinfer (not
installable here). This test loads the wheel's `tensorrt/plugin/*.py` unchanged over a permissive
stand-in for the native module (base classes and enums only), so NVIDIA's own code runs:
`@register` / `@aot_impl` signature validation, the plugin creator's attribute conversion (`create_plugin`
with fields shaped as onnx-tensorrt passes them: int32[1] / float32[1]) and `get_output_data_types`,
which calls octavo's describe function and builds the output -> input aliasing map TensorRT queries.

Point OCTAVO_TENSORRT_BINDINGS at an unpacked bindings wheel's package folder (the one holding
`plugin/`), e.g. after
    pip download --no-deps tensorrt-cu13-bindings==11.4.0.106 -d /tmp/w && unzip /tmp/w/*.whl -d /tmp/w
    export OCTAVO_TENSORRT_BINDINGS=/tmp/w/tensorrt_bindings
Several folders may be given, separated by os.pathsep (e.g. 11.4 and 10.16). Without it: skipped.
Nothing from the wheel is copied into this repository.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
BINDINGS = [Path(p) for p in os.environ.get("OCTAVO_TENSORRT_BINDINGS", "").split(os.pathsep) if p]
BINDINGS = [p for p in BINDINGS if (p / "plugin" / "_lib.py").is_file()]

pytestmark = pytest.mark.skipif(not BINDINGS, reason="OCTAVO_TENSORRT_BINDINGS (an unpacked tensorrt bindings wheel) not set")

WORKER = r'''
import enum, importlib.util, json, re, sys, types
import numpy as np

bindings, version = sys.argv[1], sys.argv[2]


class _Any:
    """Whatever the native layer would return; only octavo-independent plumbing touches it."""
    def __init__(self, *a, **k): pass
    def __getattr__(self, name): return _Any()
    def __call__(self, *a, **k): return _Any()


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


def _missing(self, name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Any()


class Native(types.ModuleType):
    """Any missing native class becomes an empty base class (the plugin classes subclass them)."""
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _Meta(name, (), {"__init__": lambda self, *a, **k: None, "__getattr__": _missing})
        setattr(self, name, cls)
        return cls


trt = Native("tensorrt")
trt.__path__ = [bindings]
trt.__version__ = version
trt.DataType = enum.Enum("DataType", "FLOAT HALF INT8 INT32 BOOL UINT8 FP8 BF16 INT64 INT4 FP4 E8M0")
D = trt.DataType
trt.float32, trt.float16, trt.bfloat16, trt.int32, trt.int64 = D.FLOAT, D.HALF, D.BF16, D.INT32, D.INT64
trt.PluginFieldType = enum.Enum("PluginFieldType", "FLOAT16 FLOAT32 FLOAT64 INT8 INT16 INT32 CHAR DIMS UNKNOWN BF16 INT64 FP8 INT4")
trt.QuickPluginCreationRequest = enum.Enum("QuickPluginCreationRequest", "UNKNOWN PREFER_JIT PREFER_AOT STRICT_JIT STRICT_AOT")
trt.TensorRTPhase = enum.Enum("TensorRTPhase", "BUILD RUNTIME")
trt.Dims = type("Dims", (), {"MAX_DIMS": 8})


class PluginField:
    def __init__(self, name, data=None, type=None):
        self.name, self.data, self.type = name, data, type


class Registry:
    def __init__(self):
        self.creators = {}
    def get_creator(self, name, version, namespace=""):
        return self.creators.get((name, version, namespace))
    def register_creator(self, creator, namespace):
        self.creators[(creator.name, "1", namespace)] = creator
        return True


registry = Registry()
trt.PluginField = PluginField
trt.PluginFieldCollection = list
trt.get_plugin_registry = lambda: registry
sys.modules["tensorrt"] = trt

import tensorrt.plugin as trtp  # the wheel's Python, unchanged

spec = importlib.util.spec_from_file_location("octavo_plugin", sys.argv[3])
plugin_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin_module)
result = {}
plugin_module.register(arch=90)  # runs trtp.register + trtp.aot_impl validation on octavo's functions
creator = registry.get_creator("PagedAttention", "1", "octavo")
result["registered"] = creator is not None
plugin_module.register(arch=90)  # idempotent: the registry now has the creator

# fields exactly as onnx-tensorrt's fallback importer builds them: the creator's field names, in order,
# INT attributes as int32[1], FLOAT ones as float32[1]
node_attrs = {"num_heads": 32, "kv_num_heads": 8, "scale": 0.088388, "sliding_window": 0, "softcap": 0.0}
field_names = [f.name for f in creator.field_names]
result["field_names"] = field_names
fields = [PluginField(n, np.array([v], np.int32 if isinstance(v, int) else np.float32)) for n, v in node_attrs.items()]
try:
    plugin = creator.create_plugin("PagedAttention", "octavo", fields, trt.TensorRTPhase.BUILD,
                                   trt.QuickPluginCreationRequest.STRICT_AOT)
except Exception as exc:
    result["create_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(result)); sys.exit(0)
result["plugin_class"] = type(plugin).__name__
result["attrs"] = {k: [type(v).__name__, v] for k, v in plugin.attrs.items()}
types_in = [D.HALF] * 5 + [D.INT32, D.INT32, D.INT32, D.INT64]
out_types = plugin.get_output_data_types(types_in, [2, 2, 2, 4, 4, 1, 1, 2, 1])
result["output_types"] = [t.name for t in out_types]
result["aliased"] = {str(i): plugin.get_aliased_input(i) for i in range(3)}
print(json.dumps(result))
'''


def _run(bindings: Path, version: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    plugin = ROOT / "octavo" / "tensorrt" / "plugin.py"
    proc = subprocess.run([sys.executable, "-c", WORKER, str(bindings), version, str(plugin)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _version(bindings: Path) -> str:
    init = (bindings / "__init__.py").read_text()
    marker = '__version__ = "'
    return init[init.index(marker) + len(marker):].split('"')[0]


@pytest.mark.parametrize("bindings", BINDINGS, ids=[_version(b) for b in BINDINGS])
def test_plugin_against_real_tensorrt_plugin_python(bindings: Path) -> None:
    import numpy as np

    version = _version(bindings)
    result = _run(bindings, version)
    assert result["registered"], result
    assert result["field_names"] == ["num_heads", "kv_num_heads", "scale", "sliding_window", "softcap"]
    old = tuple(int(p) for p in version.split(".")[:2]) < (11, 3)
    if old and tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4):
        # tensorrt.plugin < 11.3 converts int(np.array([v])): numpy >= 2.4 refuses. octavo's builder
        # refuses this pair up front (check_tensorrt_numpy); here NVIDIA's own code shows why.
        assert "only 0-dimensional arrays can be converted to Python scalars" in result["create_error"], result
        return
    assert "create_error" not in result, result
    assert result["plugin_class"] == "_TemplateAOTPlugin"  # STRICT_AOT honoured: the AOT implementation
    assert result["attrs"]["num_heads"] == ["int", 32] and result["attrs"]["kv_num_heads"] == ["int", 8]
    assert result["attrs"]["scale"][0] == "float" and abs(result["attrs"]["scale"][1] - 0.088388) < 1e-6
    # octavo's describe: output like the query; pools aliased to inputs 3 and 4 (what getAliasedInput answers)
    assert result["output_types"] == ["HALF", "HALF", "HALF"]
    assert result["aliased"] == {"0": -1, "1": 3, "2": 4}
