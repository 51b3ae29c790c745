"""Build a TensorRT engine from an octavo export folder (ONNX parser + builder, one optimization profile).

Steps: register the `octavo::PagedAttention` plugin (compiles the Triton kernel for this GPU), rewrite
the ONNX for the parser (`prepare_onnx_for_tensorrt`), parse, give every dynamic graph input a
min/opt/max range (packed tokens T, sequences B, block-table width, logits rows N, pool rows), build,
and write `model.<dtype>.engine` + `tensorrt.json` (what the runtime backend needs) next to the manifest.

Precision: TensorRT 11 builds every network strongly typed (its BuilderFlag has no FP16/BF16), so the
dtype is written into the ONNX (`prepare_onnx_for_tensorrt(kv_dtype=...)`) and no precision flag is set;
on TensorRT 10 the network is created with NetworkDefinitionCreationFlag.STRONGLY_TYPED so both behave
the same. The KV pools are written in place through aliased plugin outputs, which TensorRT honours only
with PreviewFeature.ALIASED_PLUGIN_IO_10_03 on (`configure_builder`).

Pool rows: the profile's maximum is the pool the runtime will really allocate (by default what fits in
`gpu_memory_utilization` of the build GPU's free memory), not an arbitrary bound, so that an engine that copies
around the aliased plugin reserves no more than one real pool. After the build the engine's own device memory
(`device_memory_size_v2`) is compared with one layer's pools at that maximum: an engine that reserves that much
copies the pools every step and is refused (`kv_copy_suspected`).

Written from TensorRT's documented Python API and checked on CPU against a stand-in that enforces those
rules (tests/tensorrt_standin); not yet run with real TensorRT (docs/tensorrt.md).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy

from octavo.errors import BackendUnavailableError, ModelFormatError, OctavoError
from octavo.export.manifest import Manifest
from octavo.tensorrt.engine_info import BuildInfo, kv_copy_suspected, pool_blocks_for_memory, pool_output_name
from octavo.tensorrt.onnx_rewrite import prepare_onnx_for_tensorrt
from octavo.tensorrt.trt_import import import_tensorrt

log = logging.getLogger(__name__)

DTYPES = ("float16", "bfloat16", "float32")


class EngineBuildError(OctavoError):
    """TensorRT's parser or builder refused the model; the message carries TensorRT's own errors."""


@dataclass(slots=True)
class TensorRTBuildOptions:
    dtype: str = "float16"  # activations (builder precision flag) and the KV pool dtype
    block_size: int = 16
    max_num_tokens: int = 2048  # packed tokens per step (the scheduler's max_num_batched_tokens)
    max_num_seqs: int = 64
    max_blocks_per_seq: int | None = None  # default: ceil(max_context / block_size)
    max_num_logits: int | None = None  # default: max_num_seqs (one next-token row per sequence)
    max_num_blocks: int | None = None  # pool rows the runtime may allocate; None: what fits on the build GPU
    gpu_memory_utilization: float = 0.85  # share of the build GPU's free memory for the pools (max_num_blocks=None)
    workspace_bytes: int = 1 << 30

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_tokens", "max_num_seqs", "max_num_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")


# tensorrt.plugin before 11.3 converts a plugin attribute with `int(np.array([v]))` (create_plugin in
# tensorrt/plugin/_lib.py), which numpy >= 2.4 refuses (TypeError: only 0-dimensional arrays ...).
ATTRIBUTE_FIX_VERSION = (11, 3)
NUMPY_STRICT_SCALARS = (2, 4)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_tensorrt_numpy(trt_version: str, numpy_version: str) -> None:
    """Refuse the TensorRT/numpy pair whose tensorrt.plugin cannot read plugin attributes."""
    if _version_tuple(trt_version)[:2] < ATTRIBUTE_FIX_VERSION and _version_tuple(numpy_version)[:2] >= NUMPY_STRICT_SCALARS:
        raise BackendUnavailableError(
            f"TensorRT {trt_version}'s tensorrt.plugin cannot read plugin attributes with numpy {numpy_version} "
            "(it calls int() on a 1-element array, a TypeError since numpy 2.4): "
            "pip install 'tensorrt>=11.3' or 'numpy<2.4'"
        )


def network_flags(trt: ModuleType) -> int:
    """Creation flags: strongly typed (explicit in TensorRT 10; always on, flag deprecated, in 11)."""
    if _version_tuple(trt.__version__)[0] >= 11:
        return 0
    typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if typed is None:
        raise BackendUnavailableError(f"TensorRT {trt.__version__} has no strongly typed networks; octavo needs >= 10.9")
    return 1 << int(typed)


def configure_builder(trt: ModuleType, config, workspace_bytes: int, dtype: str = "float16") -> None:  # noqa: ANN001
    """Workspace limit, the preview feature that makes the plugin's aliased pool outputs in-place, and for a
    float32 engine no TF32 (TensorRT enables BuilderFlag.TF32 by default: fp32 GEMMs would round to 10 bits)."""
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if dtype == "float32" and tf32 is not None:
        config.clear_flag(tf32)
    feature = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
    if feature is None:
        raise BackendUnavailableError(f"TensorRT {trt.__version__} lacks PreviewFeature.ALIASED_PLUGIN_IO_10_03 "
                                      "(in-place plugin outputs); octavo needs TensorRT >= 10.9")
    config.set_preview_feature(feature, True)


def profile_shapes(manifest: Manifest, options: TensorRTBuildOptions, max_blocks_per_seq: int,
                   max_num_logits: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) per graph input, in the contract's names. Pure: unit-tested without TensorRT."""
    t_max, b_max = options.max_num_tokens, options.max_num_seqs
    t_opt, b_opt = min(t_max, 256), min(b_max, 16)
    w_opt = min(max_blocks_per_seq, 64)
    n_opt = min(max_num_logits, b_opt)
    pool_tail = (options.block_size, manifest.num_kv_heads, manifest.head_dim)
    shapes = {
        "input_ids": ((1,), (t_opt,), (t_max,)),
        "position_ids": ((1,), (t_opt,), (t_max,)),
        "cumulative_sequence_length": ((2,), (b_opt + 1,), (b_max + 1,)),
        "past_seqlens": ((1,), (b_opt,), (b_max,)),
        "block_table": ((1, 1), (b_opt, w_opt), (b_max, max_blocks_per_seq)),
        "slot_mapping": ((1,), (t_opt,), (t_max,)),
        "logits_indices": ((1,), (n_opt,), (max_num_logits,)),
    }
    n_pool = options.max_num_blocks
    if n_pool is None:
        raise ValueError("max_num_blocks must be resolved (default_pool_blocks) before the profile is made")
    for layer in range(manifest.num_layers):
        for kind in ("key_cache", "value_cache"):
            shapes[f"{kind}.{layer}"] = ((1, *pool_tail), (min(n_pool, 4096), *pool_tail), (n_pool, *pool_tail))
    return shapes


def shapes_for_pools(manifest: Manifest) -> list[str]:
    """The pool input names, key_cache.0, value_cache.0, ... (graph order)."""
    return [f"{kind}.{layer}" for layer in range(manifest.num_layers) for kind in ("key_cache", "value_cache")]


def _parser_errors(parser) -> str:  # noqa: ANN001
    return "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or "(no parser errors reported)"


def check_float_weights(model_dir: Path, manifest: Manifest) -> None:
    """TensorRT runs float weights only: a quantized export (MatMulNBits, or a GGUF's own blocks as
    octavo.BlockMatMul) is a ModelFormatError saying so, checked before TensorRT is imported so that a machine
    without it gets this reason rather than "TensorRT is not installed"."""
    if manifest.weights != "fp32":
        from octavo.export.quant_options import methods_of, not_on_tensorrt

        raise ModelFormatError(not_on_tensorrt(f"{model_dir} holds {manifest.weights} weights, which",
                                               methods_of(manifest.quantization)))
    if manifest.moe is not None:
        from octavo.export.moe_spec import moe_not_on_tensorrt

        raise ModelFormatError(moe_not_on_tensorrt(str(model_dir)))


MAX_POOL_BLOCKS = 1 << 24  # a bound on the default sizing only (16.7 M blocks of 16 tokens)
# The default also keeps every pool under 2^31 elements: the kernel indexes with int64, but whether TensorRT takes
# plugin I/O tensors that large has not been run (an explicit --max-num-blocks may exceed it).
MAX_POOL_ELEMENTS = (1 << 31) - 1


def default_pool_blocks(free_bytes: int, manifest: Manifest, options: TensorRTBuildOptions) -> int:
    """The profile's pool rows when not given: the pool the runtime allocates on this GPU (same rule)."""
    per_block = manifest.kv_bytes_per_block(options.block_size, options.dtype)
    elements = options.block_size * manifest.num_kv_heads * manifest.head_dim  # of one block in one pool
    cap = min(MAX_POOL_BLOCKS, MAX_POOL_ELEMENTS // elements)
    blocks = pool_blocks_for_memory(free_bytes, options.gpu_memory_utilization, per_block, cap)
    if blocks < 1:
        raise EngineBuildError(f"no KV block ({per_block} bytes) fits in {options.gpu_memory_utilization} of the "
                               f"GPU's {free_bytes} free bytes; free memory or pass --max-num-blocks")
    return blocks


def engine_device_memory(trt: ModuleType, logger, serialized) -> int:  # noqa: ANN001
    """The engine's own device memory at the profile maxima (device_memory_size_v2; 0 if unreadable)."""
    engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(serialized))
    if engine is None:
        raise EngineBuildError("TensorRT cannot deserialize the engine it has just built; see its messages above")
    size = getattr(engine, "device_memory_size_v2", None)
    return int(size if size is not None else getattr(engine, "device_memory_size", 0) or 0)


def check_device_memory(device_bytes: int, layer_pool_bytes: int) -> None:
    """Refuse an engine whose own memory shows it copies the pools around the plugin (see kv_copy_suspected)."""
    suspected = kv_copy_suspected(device_bytes, layer_pool_bytes)
    if suspected:
        raise EngineBuildError(
            f"the engine reserves {device_bytes} bytes of device memory, at least one layer's K/V pools at the "
            f"profile maximum ({layer_pool_bytes} bytes): TensorRT copies the pools around the in-place attention "
            "plugin instead of aliasing them, so every step would move the whole KV cache. Report it with "
            "TensorRT's version and the verbose build log; a smaller --max-num-blocks only hides it")
    log.info("engine device memory %d bytes vs %d bytes of K/V pools per layer: %s", device_bytes, layer_pool_bytes,
             "no copies" if suspected is False else "pools too small to tell")


def build_engine(model_dir: str | Path, options: TensorRTBuildOptions | None = None) -> Path:
    """Build the engine for the export folder MODEL_DIR; returns the engine file's path."""
    options = options or TensorRTBuildOptions()
    options.validate()
    model_dir = Path(model_dir)
    manifest = Manifest.load(model_dir)
    check_float_weights(model_dir, manifest)
    trt = import_tensorrt()
    check_tensorrt_numpy(trt.__version__, numpy.__version__)  # building creates plugins from attributes
    from octavo.tensorrt import plugin
    from octavo.tensorrt.cuda_api import check, compute_capability, driver_cuda_version, import_cudart, ptx_version_cap

    cudart = import_cudart()
    arch = compute_capability(cudart)
    if options.max_num_blocks is None:
        free, _total = check(cudart.cudaMemGetInfo(), "cudaMemGetInfo")
        options = dataclasses.replace(options, max_num_blocks=default_pool_blocks(free, manifest, options))
        log.info("KV pool rows of the profile: %d blocks (%.0f%% of the free GPU memory)", options.max_num_blocks,
                 100 * options.gpu_memory_utilization)
    ptx_cap = ptx_version_cap(driver_cuda_version(cudart))
    plugin.register(arch=arch, ptx_version=ptx_cap)

    max_blocks_per_seq = options.max_blocks_per_seq or math.ceil(manifest.max_context / options.block_size)
    max_num_logits = options.max_num_logits or options.max_num_seqs
    started = time.perf_counter()
    onnx_path = prepare_onnx_for_tensorrt(
        model_dir / manifest.onnx_file, model_dir / f"model.tensorrt.{options.dtype}.onnx",
        block_size=options.block_size, kv_dtype=options.dtype,
    )

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path}:\n{_parser_errors(parser)}")

    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    missing = [pool_output_name(name) for name in shapes_for_pools(manifest) if pool_output_name(name) not in outputs]
    if missing:
        raise EngineBuildError(f"the parsed network lacks the aliased pool outputs {missing[:4]}; TensorRT writes "
                               "the pools in place only through network outputs")

    config = builder.create_builder_config()
    configure_builder(trt, config, options.workspace_bytes, options.dtype)  # no precision flag: types are in the ONNX
    profile = builder.create_optimization_profile()
    shapes = profile_shapes(manifest, options, max_blocks_per_seq, max_num_logits)
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name not in shapes:
            raise EngineBuildError(f"graph input {name!r} is not part of octavo's ONNX contract")
        profile.set_shape(name, *shapes[name])
    config.add_optimization_profile(profile)

    log.info("building TensorRT engine for sm_%d (%s), this takes a while", arch, options.dtype)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError("TensorRT's builder failed; see the TensorRT messages above")
    layer_pool_bytes = manifest.kv_bytes_per_block(options.block_size, options.dtype) // manifest.num_layers \
        * options.max_num_blocks
    device_bytes = engine_device_memory(trt, logger, serialized)
    check_device_memory(device_bytes, layer_pool_bytes)
    engine_path = model_dir / f"model.{options.dtype}.engine"
    engine_path.write_bytes(bytes(serialized))
    BuildInfo(
        engine_file=engine_path.name, dtype=options.dtype, block_size=options.block_size,
        max_num_tokens=options.max_num_tokens, max_num_seqs=options.max_num_seqs,
        max_blocks_per_seq=max_blocks_per_seq, max_num_logits=max_num_logits,
        max_num_blocks=options.max_num_blocks, compute_capability=arch,
        tensorrt_version=trt.__version__, build_seconds=round(time.perf_counter() - started, 2),
        device_memory_bytes=device_bytes, kv_pool_bytes_per_layer=layer_pool_bytes,
    ).save(model_dir)
    return engine_path
