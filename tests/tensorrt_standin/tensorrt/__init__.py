"""Stand-in for the `tensorrt` Python bindings (tests only; rules and limits in ../README.md).

The version it pretends to be comes from OCTAVO_TRT_STANDIN_VERSION (default 11.4.0.106); the API
differences octavo must handle follow it (BuilderFlag without FP16/BF16 from 11, EXPLICIT_BATCH gone,
plugin attribute conversion fixed in 11.3).

How it honours an aliased plugin output is chosen by the environment, because TensorRT does not promise one:
OCTAVO_TRT_STANDIN_ALIAS_REPORT = "none" (default: `get_aliased_input_tensor` answers None even for an aliased
output, as TensorRT may) or "exact"; OCTAVO_TRT_STANDIN_ALIAS_COPIES = "1": TensorRT inserts copies around the
aliased plugin (the plugin writes an engine buffer seeded from the input, the engine copies it to wherever the
output is bound; its device memory then holds a layer's pools at the profile maximum).
"""
from __future__ import annotations

import enum
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__version__ = os.environ.get("OCTAVO_TRT_STANDIN_VERSION", "11.4.0.106")
_MAJOR_MINOR = tuple(int(p) for p in __version__.split(".")[:2])
_log = logging.getLogger("tensorrt.standin")
ALIGNMENT = 256
ALIAS_REPORT = os.environ.get("OCTAVO_TRT_STANDIN_ALIAS_REPORT", "none")
ALIAS_COPIES = os.environ.get("OCTAVO_TRT_STANDIN_ALIAS_COPIES", "0") == "1"
ACTIVATION_BYTES = 1 << 20  # the stand-in engine's own device memory when nothing is copied
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
ERRORS: list[str] = []  # what a real TensorRT would print through its logger (tests read it)


def _error(message: str) -> None:
    ERRORS.append(message)
    _log.error(message)


class DataType(enum.Enum):
    FLOAT = "float32"
    HALF = "float16"
    BF16 = "bfloat16"
    INT32 = "int32"
    INT64 = "int64"


float32, float16, bfloat16, int32, int64 = DataType.FLOAT, DataType.HALF, DataType.BF16, DataType.INT32, DataType.INT64
_ONNX_TYPES = {1: DataType.FLOAT, 10: DataType.HALF, 16: DataType.BF16, 6: DataType.INT32, 7: DataType.INT64}

_flag_names = ["TF32", "REFIT", "STRICT_NANS"] + (["FP16", "BF16", "INT8"] if _MAJOR_MINOR[0] < 11 else [])
BuilderFlag = enum.IntEnum("BuilderFlag", _flag_names)
NetworkDefinitionCreationFlag = enum.IntEnum(
    "NetworkDefinitionCreationFlag",
    (["EXPLICIT_BATCH"] if _MAJOR_MINOR[0] < 11 else []) + ["STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS",
                                                              "PREFER_JIT_PYTHON_PLUGINS"], start=0)
PreviewFeature = enum.IntEnum("PreviewFeature", ["PROFILE_SHARING_0806", "ALIASED_PLUGIN_IO_10_03"], start=0)
MemoryPoolType = enum.IntEnum("MemoryPoolType", ["WORKSPACE"], start=0)
TensorIOMode = enum.IntEnum("TensorIOMode", ["NONE", "INPUT", "OUTPUT"], start=0)


class Logger:
    VERBOSE, INFO, WARNING, ERROR = 0, 1, 2, 3

    def __init__(self, severity: int = 2) -> None:
        self.severity = severity

    def log(self, severity: int, message: str) -> None:
        _log.log(logging.WARNING if severity >= 2 else logging.INFO, message)


# ---- plugin registry (creators are added by tensorrt.plugin.register) -----------------------------
@dataclass
class _Creator:
    name: str
    version: str
    namespace: str
    field_names: list[str]  # the register function's attributes, in order


class _Registry:
    def __init__(self) -> None:
        self.creators: dict[tuple[str, str, str], _Creator] = {}

    def _add(self, name: str, version: str, namespace: str, field_names: list[str]) -> None:
        self.creators[(name, version, namespace)] = _Creator(name, version, namespace, field_names)

    def get_creator(self, name: str, version: str, namespace: str = "") -> _Creator | None:
        return self.creators.get((name, version, namespace))


_REGISTRY = _Registry()


def get_plugin_registry() -> _Registry:
    return _REGISTRY


# ---- network, parser ------------------------------------------------------------------------------
@dataclass
class _Tensor:
    name: str
    dtype: DataType
    shape: tuple[int, ...]  # -1 = dynamic


@dataclass
class _PluginLayer:
    node_name: str
    plugin_id: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    aliased: dict[int, int]  # output index -> input index (what getAliasedInput answers)
    kernel: dict = field(default_factory=dict)


class INetworkDefinition:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.inputs: list[_Tensor] = []
        self.outputs: list[_Tensor] = []
        self.plugins: list[_PluginLayer] = []
        self.onnx_path: str | None = None
        self.value_types: dict[str, DataType] = {}

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_input(self, i: int) -> _Tensor:
        return self.inputs[i]

    def get_output(self, i: int) -> _Tensor:
        return self.outputs[i]


def _value_info(vi: Any) -> _Tensor:  # noqa: ANN401
    tt = vi.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
    return _Tensor(vi.name, _ONNX_TYPES[tt.elem_type], dims)


class OnnxParser:
    """Reads the ONNX with `onnx`; nodes without a builtin importer go to the plugin registry like
    onnx-tensorrt's fallback importer: creator by (op_type, plugin_version, plugin_namespace), fields
    from the creator's field names, INT -> int32[1], FLOAT -> float32[1]."""

    def __init__(self, network: INetworkDefinition, logger: Logger) -> None:
        self.network, self.errors = network, []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, i: int) -> str:
        return self.errors[i]

    def parse_from_file(self, path: str) -> bool:
        import onnx
        from onnx import helper

        model = onnx.load(path, load_external_data=False)
        net = self.network
        net.onnx_path = path
        net.inputs = [_value_info(vi) for vi in model.graph.input]
        net.outputs = [_value_info(vi) for vi in model.graph.output]
        for node in model.graph.node:
            if node.op_type != "PagedAttention":
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            namespace = attrs.get("plugin_namespace", b"").decode()
            version = attrs.get("plugin_version", b"1").decode()
            creator = _REGISTRY.get_creator(node.op_type, version, namespace)
            if creator is None:
                self.errors.append(f"{node.name}: Plugin not found, are the plugin name, version, and namespace correct?")
                return False
            fields = {}
            for name in creator.field_names:
                if name not in attrs:
                    continue  # onnx-tensorrt warns and leaves it out
                value = attrs[name]
                fields[name] = np.array([value], np.int32 if isinstance(value, int) else np.float32)
            try:
                net.plugins.append(self._create(node, attrs, fields))
            except Exception as exc:  # noqa: BLE001 - the parser reports any plugin exception as a node error
                self.errors.append(f"{node.name}: plugin creation failed: {type(exc).__name__}: {exc}")
                return False
        return True

    def _create(self, node: Any, attrs: dict, fields: dict[str, np.ndarray]) -> _PluginLayer:  # noqa: ANN401
        from tensorrt import plugin as trtp

        plugin_id = f"{attrs['plugin_namespace'].decode()}::{node.op_type}"
        definition = trtp.REGISTRY[plugin_id]
        converted = {}
        for name, data in fields.items():
            annotation = definition.input_attrs[name]
            # tensorrt.plugin's create_plugin: < 11.3 annotation(array) (TypeError on numpy >= 2.4), then array[0]
            converted[name] = annotation(data) if _MAJOR_MINOR < (11, 3) else annotation(data[0])
        if int(attrs.get("aot", 0)) != 1:
            raise ValueError("no 'aot' attribute: the parser would not request the AOT implementation")
        if definition.aot_impl_func is None:
            raise ValueError(f"AOT implementation requested, but not defined for '{plugin_id}'")
        types = self.network.value_types
        descs = [trtp.TensorDesc(self._type_of(name, types), ()) for name in node.input]
        outs = definition.register_func(*descs, **converted)
        outs = outs if isinstance(outs, tuple) else (outs,)
        aliased = {i: next(j for j, d in enumerate(descs) if d is o.get_aliased()) for i, o in enumerate(outs) if o.get_aliased() is not None}
        for i, o in enumerate(outs):
            types[node.output[i]] = o.dtype
        return _PluginLayer(node.name, plugin_id, list(node.input), list(node.output), converted, aliased)

    def _type_of(self, name: str, types: dict[str, DataType]) -> DataType:
        for tensor in self.network.inputs:
            if tensor.name == name:
                return tensor.dtype
        return types.get(name, DataType.FLOAT)


# ---- builder --------------------------------------------------------------------------------------
class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name: str, lo: tuple, opt: tuple, hi: tuple) -> None:
        if not (len(lo) == len(opt) == len(hi) and all(a <= b <= c for a, b, c in zip(lo, opt, hi))):
            raise ValueError(f"invalid profile for {name}: {lo} {opt} {hi}")
        self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))


class IBuilderConfig:
    def __init__(self) -> None:
        self.flags: set = {BuilderFlag.TF32}  # on by default, as in TensorRT
        self.cleared: set = set()
        self.preview: set = set()
        self.profiles: list[IOptimizationProfile] = []
        self.pool_limits: dict = {}

    def set_flag(self, flag: Any) -> None:  # noqa: ANN401
        self.flags.add(flag)

    def clear_flag(self, flag: Any) -> None:  # noqa: ANN401
        self.flags.discard(flag)
        self.cleared.add(flag)

    def set_preview_feature(self, feature: Any, enable: bool) -> None:  # noqa: ANN401
        (self.preview.add if enable else self.preview.discard)(feature)

    def set_memory_pool_limit(self, pool: Any, size: int) -> None:  # noqa: ANN401
        self.pool_limits[pool] = size

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        if _MAJOR_MINOR[0] < 11 and not flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)):
            _log.warning("weakly typed network: precision follows builder flags (deprecated)")
        return INetworkDefinition(flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def _strongly_typed(self, network: INetworkDefinition) -> bool:
        return _MAJOR_MINOR[0] >= 11 or bool(network.flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)))

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> bytes | None:
        from tensorrt import plugin as trtp

        precision = {f for f in config.flags if f.name in ("FP16", "BF16", "INT8")}
        if self._strongly_typed(network) and precision:
            _error(f"precision flags {sorted(f.name for f in precision)} are not allowed for a strongly typed network")
            return None
        if len(config.profiles) != 1:
            _error("octavo's networks need exactly one optimization profile")
            return None
        profile = config.profiles[0].shapes
        for tensor in network.inputs:
            if -1 in tensor.shape and tensor.name not in profile:
                _error(f"dynamic input {tensor.name} has no optimization profile")
                return None
        output_names = {t.name for t in network.outputs}
        in_place = ALIASED = PreviewFeature.ALIASED_PLUGIN_IO_10_03 in config.preview
        aliases: dict[str, str] = {}  # network output -> network input it shares memory with
        scratch: dict[str, str] = {}  # aliased outputs the engine writes to a buffer of its own -> input
        inputs = {t.name: t for t in network.inputs}
        for layer in network.plugins:
            definition = trtp.REGISTRY[layer.plugin_id]
            shapes_in = [inputs[n] if n in inputs else _Tensor(n, network.value_types.get(n, DataType.FLOAT), (-1, -1))
                         for n in layer.inputs]
            try:
                layer.kernel = self._aot(definition, layer, shapes_in, network.value_types)
            except (TypeError, ValueError) as exc:
                _error(f"{layer.node_name}: AOT plugin rejected: {exc}")
                return None
            for out_index, in_index in layer.aliased.items():
                out, inp = layer.outputs[out_index], layer.inputs[in_index]
                if in_place and out in output_names and inp in inputs:
                    aliases[out] = inp
                else:
                    scratch[out] = inp
        if not ALIASED and any(layer.aliased for layer in network.plugins):
            _log.warning("aliased plugin I/O ignored: PreviewFeature.ALIASED_PLUGIN_IO_10_03 is off")
        copied = dict(aliases) if ALIAS_COPIES else {}
        device_memory = ACTIVATION_BYTES
        if copied or scratch:  # a buffer per copied/engine-owned pool output, reused across layers: one layer's K+V
            per_pool = [int(np.prod(profile[inp][2])) * _ITEMSIZE[inputs[inp].dtype.value]
                        for inp in {**copied, **scratch}.values() if inp in profile]
            device_memory += 2 * max(per_pool, default=0)
        engine = {
            "version": __version__, "onnx": network.onnx_path,
            "inputs": [[t.name, t.dtype.value, list(t.shape)] for t in network.inputs],
            "outputs": [[t.name, t.dtype.value, list(t.shape)] for t in network.outputs],
            "profile": {k: [list(x) for x in v] for k, v in profile.items()},
            "aliases": aliases, "scratch_outputs": scratch, "copied_aliases": copied,
            "device_memory": device_memory,
            "kernels": [layer.kernel for layer in network.plugins],
        }
        return json.dumps(engine).encode()

    def _aot(self, definition: Any, layer: _PluginLayer, tensors: list[_Tensor], types: dict) -> dict:  # noqa: ANN401
        """What TensorRT does at build time with an AOT plugin: call aot_impl with the I/O descriptions
        and record kernel name, PTX and the symbolic launch parameters (evaluated at run time)."""
        from tensorrt import plugin as trtp

        def desc(index: int, tensor: _Tensor) -> trtp.TensorDesc:
            dims = tuple(trtp.ShapeExpr(d) if d >= 0 else trtp.ShapeExpr(source=(index, axis))
                         for axis, d in enumerate(tensor.shape))
            return trtp.TensorDesc(tensor.dtype, dims)

        descs = [desc(i, t) for i, t in enumerate(tensors)]
        outputs = tuple(trtp.TensorDesc(types.get(name, DataType.FLOAT), ()) for name in layer.outputs)
        name, ptx, params, extras = definition.aot_impl_func(*descs, *layer.attrs.values(), outputs, 0)
        if not isinstance(name, (str, bytes)) or not isinstance(ptx, (str, bytes)):
            raise TypeError("kernel name and PTX must be str or bytes")
        if not isinstance(params, trtp.KernelLaunchParams) or not isinstance(extras, trtp.SymExprs):
            raise TypeError("aot_impl must return KernelLaunchParams and SymIntExprs")
        if not all(isinstance(e, trtp.SymInt32) for e in extras):
            raise TypeError("every extra argument must be a SymInt32")
        ptx_text = ptx.decode() if isinstance(ptx, bytes) else ptx
        name_text = name.decode() if isinstance(name, bytes) else name
        if f".entry {name_text}(" not in ptx_text:
            raise ValueError(f"kernel {name_text!r} is not an entry of the PTX")
        def as_json(value: Any) -> Any:  # noqa: ANN401
            return value.to_json() if isinstance(value, trtp.ShapeExpr) else int(value)

        entry = ptx_text[ptx_text.index(f".entry {name_text}("):]
        entry = entry[:entry.index(")")]
        passed = len(layer.inputs) + len(extras) + len(layer.outputs)  # TensorRT's kernelParams entries
        if entry.count(".param") != passed:
            raise ValueError(f"kernel {name_text} declares {entry.count('.param')} parameters; the AOT launch passes "
                             f"{passed} (inputs, extras, outputs): the driver would read past the argument array")
        return {"name": name_text, "ptx_chars": len(ptx_text), "ptx_params": entry.count(".param"),
                "inputs": list(layer.inputs),
                "params": {k: as_json(getattr(params, k)) for k in ("grid_x", "grid_y", "grid_z", "block_x", "shared_mem")},
                "extras": [as_json(e.expr) for e in extras]}


# ---- runtime --------------------------------------------------------------------------------------
class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, blob: bytes) -> "ICudaEngine | None":
        try:
            return ICudaEngine(json.loads(blob))
        except ValueError:
            _error("cannot deserialize the engine")
            return None


class ICudaEngine:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.io = [(n, "input", t, s) for n, t, s in spec["inputs"]] + [(n, "output", t, s) for n, t, s in spec["outputs"]]

    @property
    def num_io_tensors(self) -> int:
        return len(self.io)

    def get_tensor_name(self, i: int) -> str:
        return self.io[i][0]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return next(TensorIOMode.INPUT if m == "input" else TensorIOMode.OUTPUT for n, m, _, _ in self.io if n == name)

    def get_aliased_input_tensor(self, name: str) -> str | None:
        """Only with OCTAVO_TRT_STANDIN_ALIAS_REPORT=exact: TensorRT does not promise to expose the aliasing."""
        return self.spec["aliases"].get(name) if ALIAS_REPORT == "exact" else None

    @property
    def device_memory_size_v2(self) -> int:
        return int(self.spec["device_memory"])

    def create_execution_context(self) -> "IExecutionContext":
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self._session = None

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        lo, _opt, hi = self.engine.spec["profile"].get(name, (None, None, None))
        if lo is not None and not (len(shape) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shape, hi))):
            _error(f"shape {tuple(shape)} of {name} is outside the profile [{lo}, {hi}]")
            return False
        self.shapes[name] = tuple(int(s) for s in shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if name not in {n for n, *_ in self.engine.io}:
            _error(f"{name} is not an I/O tensor of this engine")
            return False
        if ptr % ALIGNMENT:
            _error(f"address {ptr:#x} of {name} is not {ALIGNMENT}-byte aligned")
            return False
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream: int) -> bool:
        spec = self.engine.spec
        for name, *_ in self.engine.io:
            if name not in self.addresses:
                _error(f"no address set for {name}")
                return False
        for out, inp in spec["aliases"].items():
            if out not in spec["copied_aliases"] and self.addresses[out] != self.addresses[inp]:
                _error(f"aliased output {out} must be bound to the address of its input {inp}")
                return False
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - an enqueue failure is reported, not raised
            _error(f"execution failed: {type(exc).__name__}: {exc}")
            return False
        return True

    def _view(self, name: str, dtype: str, shape: tuple) -> np.ndarray:
        import ctypes

        np_dtype = {"bfloat16": np.uint16}.get(dtype, dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * np.dtype(np_dtype).itemsize
        buffer = (ctypes.c_char * max(nbytes, 1)).from_address(self.addresses[name])
        return np.frombuffer(buffer, dtype=np_dtype, count=count).reshape(shape)

    def _launch(self, kernel: dict, feeds: dict[str, np.ndarray]) -> dict:
        """The launch TensorRT would make for this step: grid/extras evaluated for the input shapes."""
        shapes = [tuple(feeds[n].shape) if n in feeds else self._intermediate_shape(n, feeds) for n in kernel["inputs"]]
        params = {k: evaluate_expr(v, shapes) for k, v in kernel["params"].items()}
        extras = [evaluate_expr(e, shapes) for e in kernel["extras"]]
        if params["shared_mem"] > 48 * 1024:
            raise RuntimeError(f"kernel {kernel['name']} asks for {params['shared_mem']} B of dynamic shared memory")
        return {"params": params, "extras": extras}

    def _intermediate_shape(self, name: str, feeds: dict[str, np.ndarray]) -> tuple[int, ...]:
        # q/k/v are intermediate tensors: their first dim is the step's token count
        return (int(feeds["input_ids"].shape[0]), -1)

    def _run(self) -> None:
        from onnx.reference import ReferenceEvaluator

        spec = self.engine.spec
        if self._session is None:
            import onnx

            model = onnx.load(spec["onnx"])
            self._session = ReferenceEvaluator(model, new_ops=[_reference_plugin_op()])
        feeds = {}
        for name, dtype, _shape in spec["inputs"]:
            feeds[name] = self._view(name, dtype, self.shapes[name])
        for inp in [*spec["scratch_outputs"].values(), *spec["copied_aliases"].values()]:
            # not in place: the plugin writes a buffer of the engine's own, seeded from the input; the caller's
            # pool behind the input address is updated only through a copied alias's bound output address
            feeds[inp] = feeds[inp].copy()
        self.launches = [self._launch(kernel, feeds) for kernel in spec["kernels"]]
        out_names = [name for name, *_ in spec["outputs"]]
        results = dict(zip(out_names, self._session.run(out_names, feeds)))
        for name, dtype, _shape in spec["outputs"]:
            if name in spec["scratch_outputs"] or (name in spec["aliases"] and name not in spec["copied_aliases"]):
                continue  # into the engine's own buffer, or in place through the shared address
            value = results[name]
            target = self._view(name, dtype, value.shape)
            target[...] = value


def evaluate_expr(expr: Any, shapes: list[tuple[int, ...]]) -> int:  # noqa: ANN401
    """Value of a serialized shape expression (see plugin.ShapeExpr.to_json) for concrete input shapes."""
    if isinstance(expr, int):
        return expr
    if expr[0] == "in":
        return int(shapes[expr[1]][expr[2]])
    a, b = (evaluate_expr(x, shapes) for x in expr[1:])
    return {"+": a + b, "-": a - b, "*": a * b, "//": a // b, "cdiv": -(-a // b), "max": max(a, b), "min": min(a, b)}[expr[0]]


def _as_float32(array: np.ndarray) -> np.ndarray:
    if array.dtype in (np.float32, np.float16):
        return array.astype(np.float32)
    return (array.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # bfloat16 bits


def _bfloat16_bits(array: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(array, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _reference_plugin_op():  # noqa: ANN202
    from onnx.reference.op_run import OpRun

    from octavo.reference import paged_attention_ref

    class PagedAttention(OpRun):
        op_domain = ""

        def _run(self, query, key, value, key_cache, value_cache, cu, past, table, slots,  # noqa: ANN001, ANN202, PLR0913
                 num_heads=None, kv_num_heads=None, scale=None, sliding_window=None, softcap=None,
                 plugin_namespace=None, plugin_version=None, aot=None):
            # bfloat16 arrives as raw 16-bit words (onnx's custom dtype, or the uint16 views of the pools):
            # computed in float32, the pools written back as bfloat16 bits (round to nearest even)
            bf16 = query.dtype not in (np.float32, np.float16)
            pools = [_as_float32(c) if bf16 else c for c in (key_cache, value_cache)]
            out = paged_attention_ref(_as_float32(query), _as_float32(key), _as_float32(value),
                                      pools[0], pools[1], cu, past, table, slots, num_heads=num_heads,
                                      kv_num_heads=kv_num_heads, scale=scale, sliding_window=sliding_window,
                                      softcap=softcap)
            if not bf16:
                return out.astype(query.dtype), key_cache, value_cache
            for pool, computed in zip((key_cache, value_cache), pools):
                pool.view(np.uint16)[...] = _bfloat16_bits(computed)
            return _bfloat16_bits(out).view(query.dtype), key_cache, value_cache

    return PagedAttention
