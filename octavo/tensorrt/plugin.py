"""TensorRT plugin `octavo::PagedAttention` (version "1") via TensorRT's Python plugin API (`tensorrt.plugin`).

What TensorRT gets from this module (written from TensorRT's documented API; see docs/tensorrt.md for
what has and has not been run):

* `@trtp.register`: the shape/type description. Output 0 (`output`) is like `query`; outputs 1 and 2
  are `key_cache.aliased()` / `value_cache.aliased()`: TensorRT's plugin layer reports them through
  IPluginV3OneBuildV2::getAliasedInput. That makes the pools in place only together with
  PreviewFeature.ALIASED_PLUGIN_IO_10_03 (the builder sets it), the outputs being network outputs
  (the ONNX rewrite adds them) and the runtime binding each output to its input's address (the backend).
* `@trtp.aot_impl`: the ahead-of-time implementation. It compiles the OpenAI-Triton kernel of
  `octavo.tensorrt.gpu_kernel` for the build GPU's architecture and returns
  (kernel name, PTX, KernelLaunchParams, SymIntExprs). TensorRT embeds the PTX in the engine and launches
  it itself, so a serialized engine runs without Python, triton or this module.
  TensorRT's AOT launch ABI: kernel parameters are (input pointers..., int32 extras..., output
  pointers...); the extras are `trtp.SymInt32` expressions of the input shapes. The PTX handed over declares
  exactly those 15 parameters: Triton's two trailing scratch pointers are stripped (`ptx_abi.plugin_ptx`,
  after checking the kernel never reads them), so the driver never reads past TensorRT's argument array.
  Float attributes (scale, softcap) cannot be extras (int32 only), so every node attribute is baked into
  the kernel as a constexpr: one compiled variant per distinct attribute set and dtype.

The ONNX parser finds this plugin when the node's op_type is "PagedAttention" and it carries the string
attribute plugin_namespace="octavo" (plugin_version defaults to "1"), and requests the AOT
implementation for `aot=1`: see `octavo.tensorrt.onnx_rewrite.prepare_onnx_for_tensorrt`. The parser
supplies the plugin fields in the creator's field order (= ATTRIBUTES, the describe function's
attribute order) and tensorrt.plugin hands them to the AOT function positionally in that order
(tensorrt/plugin/_plugin_class.py, get_launch_params).

Importing this module needs neither tensorrt nor triton; `register()` needs both.
"""
from typing import Tuple, Union

PLUGIN_NAMESPACE = "octavo"
PLUGIN_NAME = "PagedAttention"
PLUGIN_VERSION = "1"  # tensorrt.plugin registers every quickly-deployable plugin as version "1"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
ATTRIBUTES = {"num_heads": int, "kv_num_heads": int, "scale": float, "sliding_window": int, "softcap": float}


def launch_grid(num_tokens: int, num_seqs: int, kv_num_heads: int, block_m: int) -> Tuple[int, int]:
    """The (grid_x, grid_y) the AOT implementation asks TensorRT for, evaluated for concrete sizes."""
    from octavo.tensorrt.kernel_launch import num_tiles

    return num_tiles(num_tokens, num_seqs, block_m), kv_num_heads


def _dtype_name(trt_dtype) -> str:  # noqa: ANN001
    import tensorrt as trt

    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    if trt_dtype not in names:
        raise ValueError(f"octavo::PagedAttention supports float32/float16/bfloat16 activations, got {trt_dtype}")
    return names[trt_dtype]


def _constant(expr, what: str) -> int:  # noqa: ANN001
    """A build-time constant dimension (head width, block size); the ONNX contract fixes these."""
    if expr.is_fake or not expr.is_constant:
        raise ValueError(f"octavo::PagedAttention needs a static {what}; it is dynamic in this network")
    return int(expr.constant_value())


def register(arch: int, ptx_version: int | None = None) -> None:
    """Register `octavo::PagedAttention` in TensorRT's plugin registry (idempotent per process).

    arch: compute capability of the GPU the engine is built for, e.g. 90 for H100/H200.
    ptx_version: cap on the PTX ISA (e.g. 84 for a CUDA 12.4 driver); None = what Triton emits.
    """
    import tensorrt as trt
    import tensorrt.plugin as trtp

    if trt.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE) is not None:
        return  # already registered in this process (TensorRT's registry is per process)

    from octavo.tensorrt.gpu_kernel import KernelConfig, compile_for_aot
    from octavo.tensorrt.ptx_abi import plugin_ptx

    compiled_variants: dict[KernelConfig, tuple] = {}  # TensorRT asks once per format/tactic; compile once

    def compiled_for(config: KernelConfig):  # noqa: ANN202
        """(Triton's CompiledKernel, the PTX with exactly TensorRT's 15 parameters) of CONFIG."""
        if config not in compiled_variants:
            compiled = compile_for_aot(config, arch=arch, ptx_version=ptx_version)
            compiled_variants[config] = (compiled, plugin_ptx(compiled.asm["ptx"], compiled.metadata.name))
        return compiled_variants[config]

    @trtp.register(PLUGIN_ID)
    def _describe(
        query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        cumulative_sequence_length: trtp.TensorDesc, past_seqlens: trtp.TensorDesc,
        block_table: trtp.TensorDesc, slot_mapping: trtp.TensorDesc,
        num_heads: int, kv_num_heads: int, scale: float, sliding_window: int, softcap: float,
    ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return query.like(), key_cache.aliased(), value_cache.aliased()

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(
        query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        cumulative_sequence_length: trtp.TensorDesc, past_seqlens: trtp.TensorDesc,
        block_table: trtp.TensorDesc, slot_mapping: trtp.TensorDesc,
        num_heads: int, kv_num_heads: int, scale: float, sliding_window: int, softcap: float,
        outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        # head_dim and block size from the POOL's static dims (the query width may be a reshape result
        # TensorRT does not fold to a constant)
        config = KernelConfig(
            dtype=_dtype_name(query.dtype), num_heads=num_heads, kv_num_heads=kv_num_heads,
            head_dim=_constant(key_cache.shape_expr[3], "head_dim"),
            block_size=_constant(key_cache.shape_expr[1], "block size"),
            scale=scale, sliding_window=sliding_window, softcap=softcap,
        )
        compiled, ptx = compiled_for(config)

        tokens = query.shape_expr[0]
        seqs = past_seqlens.shape_expr[0]
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(tokens, config.block_m) + seqs  # == num_tiles(T, B, block_m)
        params.grid_y = kv_num_heads
        params.block_x = compiled.metadata.num_warps * 32
        params.shared_mem = compiled.metadata.shared

        extras = trtp.SymIntExprs(3)  # num_tokens, num_seqs, max_blocks (kernel order)
        extras[0] = trtp.SymInt32(tokens)
        extras[1] = trtp.SymInt32(seqs)
        extras[2] = trtp.SymInt32(block_table.shape_expr[1])
        return compiled.metadata.name, ptx, params, extras
