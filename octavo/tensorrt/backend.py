"""GPU backend: a TensorRT engine built by `octavo build MODEL --target tensorrt`, driven with cuda-python.

The KV pools live in device memory, one key and one value pool per layer, carved out of one allocation
sized from a fraction of the free GPU memory (or an explicit block count), each starting on a 256-byte
boundary (what `setTensorAddress` requires). Each pool's address is bound once to BOTH the engine's
`key_cache.{l}` input and its aliased output `key_cache.{l}.out` (likewise for values): the plugin
writes the new K/V through the output, so binding the output elsewhere would leave the pool stale.

Whether the engine really writes the pools in place is not taken from `get_aliased_input_tensor` (TensorRT may
insert copies around an aliased plugin and not report the aliasing; what it reports is logged and kept in
`aliasing_reported`): at start-up one probe step writes token 0's K/V into slot 0 of every pool, pre-filled
with a sentinel, and the pools are read back (`_verify_in_place`). An engine whose step leaves the sentinel is
refused with "rebuild". Per step only the small integer inputs go host -> device and only the N requested
logits rows come back.

Import-guarded: importing this module needs neither TensorRT nor cuda-python; constructing the backend
without them raises BackendUnavailableError saying why. Written from TensorRT's documented Python API
(ICudaEngine / IExecutionContext: set_input_shape, set_tensor_address, execute_async_v3); not run on
any machine of this project yet (docs/tensorrt.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from octavo.errors import BackendUnavailableError, InvalidRequestError, ModelFormatError, StepFailedError
from octavo.export.manifest import Manifest
from octavo.runtime.backends.base import StepInputs
from octavo.tensorrt.cuda_api import check, import_cudart
from octavo.tensorrt.engine_info import BuildInfo, kv_copy_suspected, pool_blocks_for_memory, pool_output_name
from octavo.tensorrt.trt_import import import_tensorrt

log = logging.getLogger(__name__)

STEP_DTYPES: dict[str, type[np.generic]] = {
    "input_ids": np.int64, "position_ids": np.int64, "cumulative_sequence_length": np.int32,
    "past_seqlens": np.int32, "block_table": np.int32, "slot_mapping": np.int64, "logits_indices": np.int64,
}


@dataclass(slots=True)
class _DeviceBuffer:
    ptr: int
    nbytes: int


TENSOR_ALIGNMENT = 256  # bytes; TensorRT's requirement on every address given to setTensorAddress


def aligned(nbytes: int, alignment: int = TENSOR_ALIGNMENT) -> int:
    """NBYTES rounded up to a multiple of ALIGNMENT."""
    return -(-nbytes // alignment) * alignment


SENTINEL_BYTE = 0xFF  # a NaN in fp32/fp16/bf16: no K/V projection writes these bits


class TensorRTBackend:
    """Runs an octavo TensorRT engine on one GPU; owns the paged KV pools in device memory."""

    def __init__(
        self,
        model_dir: str | Path,
        manifest: Manifest,
        num_blocks: int | None = None,
        block_size: int | None = None,
        *,
        memory_fraction: float = 0.85,
        device: int = 0,
    ) -> None:
        self._buffers: list[_DeviceBuffer] = []
        self._trt = import_tensorrt()
        self._cudart = import_cudart()
        self.model_dir = Path(model_dir)
        self.manifest = manifest
        self.vocab_size = manifest.vocab_size
        self.info = BuildInfo.load(self.model_dir)
        if block_size is not None and block_size != self.info.block_size:
            raise InvalidRequestError(f"the engine was built for block_size {self.info.block_size}, not {block_size}; "
                                      "rebuild with `octavo build --block-size` or use the engine's")
        self.block_size = self.info.block_size
        cudart = self._cudart
        check(cudart.cudaSetDevice(device), "cudaSetDevice")

        engine_path = self.model_dir / self.info.engine_file
        if not engine_path.is_file():
            raise ModelFormatError(f"{engine_path} is missing; rebuild with `octavo build {self.model_dir} --target tensorrt`")
        self._logger = self._trt.Logger(self._trt.Logger.WARNING)
        self._runtime = self._trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise BackendUnavailableError(f"TensorRT could not load {engine_path} (built with TensorRT "
                                          f"{self.info.tensorrt_version} for sm_{self.info.compute_capability}; "
                                          f"this is TensorRT {self._trt.__version__}); rebuild it on this machine")
        self.context = self.engine.create_execution_context()
        self.device_memory_bytes = self._engine_device_memory()
        self._stream = check(cudart.cudaStreamCreate(), "cudaStreamCreate")

        bytes_per_block = manifest.kv_bytes_per_block(self.block_size, self.info.dtype)  # the engine's pool dtype
        if num_blocks is None:
            free, _total = check(cudart.cudaMemGetInfo(), "cudaMemGetInfo")
            num_blocks = pool_blocks_for_memory(free, memory_fraction, bytes_per_block, self.info.max_num_blocks)
        if not 1 <= num_blocks <= self.info.max_num_blocks:
            raise InvalidRequestError(f"num_blocks must be in 1..{self.info.max_num_blocks} for this engine, got {num_blocks}")
        self.num_blocks = num_blocks
        self.aliasing_reported: dict[str, str | None] = {}
        self.in_place_verified = False
        try:
            self._allocate_pools(bytes_per_block)
            self._allocate_step_buffers()
            self._verify_in_place()
        except BaseException:
            self.close()
            raise

    # ---- setup --------------------------------------------------------------------------------------
    def _malloc(self, nbytes: int) -> int:
        ptr = int(check(self._cudart.cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes})"))
        self._buffers.append(_DeviceBuffer(ptr, nbytes))
        return ptr

    def _bind(self, name: str, ptr: int) -> None:
        if not self.context.set_tensor_address(name, ptr):
            raise StepFailedError(f"TensorRT refused the address {ptr:#x} for tensor {name!r} (see TensorRT's log)")

    def _set_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self.context.set_input_shape(name, shape):
            raise InvalidRequestError(f"TensorRT refused shape {shape} for input {name!r} (outside the engine's profile)")

    def _engine_device_memory(self) -> int:
        """The engine's own device memory (TensorRT >= 10.x: device_memory_size_v2), logged against the pools."""
        size = getattr(self.engine, "device_memory_size_v2", None)
        size = int(size if size is not None else getattr(self.engine, "device_memory_size", 0) or 0)
        log.info("TensorRT engine %s: %d bytes of device memory of its own (activations at the profile maxima)",
                 self.info.engine_file, size)
        if kv_copy_suspected(size, self.info.kv_pool_bytes_per_layer):
            log.warning("the engine's %d bytes of device memory are at least one layer's K/V pools at the profile "
                        "maximum (%d bytes): TensorRT likely copies the pools around the attention plugin",
                        size, self.info.kv_pool_bytes_per_layer)
        return size

    def _aliasing_report(self, pool: str) -> str | None:
        """What TensorRT reports as the input aliased to POOL's output; logged, never trusted or required (TensorRT
        may alias through inserted copies without reporting it). The probe step checks the write instead."""
        out = pool_output_name(pool)
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        if out not in names:
            raise ModelFormatError(f"{self.info.engine_file} has no output {out!r} (the pool written in place); "
                                   f"rebuild with `octavo build {self.model_dir} --target tensorrt`")
        report = getattr(self.engine, "get_aliased_input_tensor", None)
        reported = report(out) if report is not None else None
        self.aliasing_reported[out] = reported
        return reported

    def _verify_in_place(self) -> None:
        """One probe step (token 0 at position 0 into block 0, slot 0) over pools whose slot-0 rows hold a
        sentinel; every pool's row must change. Then the rows are zeroed again (the pools start empty)."""
        reported = sum(1 for out, inp in self.aliasing_reported.items() if inp == out.removesuffix(".out"))
        log.info("TensorRT reports %d of %d pool outputs aliased to their inputs (get_aliased_input_tensor)",
                 reported, len(self.aliasing_reported))
        cudart = self._cudart
        row = self.pool_row_bytes
        for name, ptr in self.pool_pointers.items():
            check(cudart.cudaMemset(ptr, SENTINEL_BYTE, row), f"cudaMemset({name} slot 0)")
        probe = StepInputs(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([0, 1], np.int32),
                           np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.zeros(1, np.int64),
                           np.zeros(1, np.int64))
        self.run(probe)
        stale = []
        for name, ptr in self.pool_pointers.items():
            host = np.empty(row, np.uint8)
            check(cudart.cudaMemcpy(host.ctypes.data, ptr, row, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost),
                  f"cudaMemcpy({name} slot 0)")
            if np.all(host == SENTINEL_BYTE):
                stale.append(name)
            check(cudart.cudaMemset(ptr, 0, row), f"cudaMemset({name} slot 0)")
        if stale:
            raise ModelFormatError(
                f"{self.info.engine_file}: a step did not write the KV pools in place ({len(stale)} of "
                f"{len(self.pool_pointers)} pools unchanged, e.g. {stale[0]!r}; TensorRT reported {reported} "
                f"aliased pool outputs): the engine writes K/V to buffers of its own, so decoding would read a stale "
                f"cache. Rebuild with `octavo build {self.model_dir} --target tensorrt` (it enables "
                "PreviewFeature.ALIASED_PLUGIN_IO_10_03 and makes the pool outputs network outputs)")
        self.in_place_verified = True
        log.info("TensorRT engine %s writes its %d KV pools in place (probe step verified)",
                 self.info.engine_file, len(self.pool_pointers))

    def _allocate_pools(self, bytes_per_block: int) -> None:
        m = self.manifest
        pool_bytes = aligned(bytes_per_block // (2 * m.num_layers) * self.num_blocks)
        self.pool_row_bytes = bytes_per_block // (2 * m.num_layers * self.block_size)  # one slot of one pool
        base = self._malloc(pool_bytes * 2 * m.num_layers)  # cudaMalloc: 256-byte aligned base
        check(self._cudart.cudaMemset(base, 0, pool_bytes * 2 * m.num_layers), "cudaMemset(pools)")
        self.pool_shape = (self.num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.pool_pointers: dict[str, int] = {}
        for layer in range(m.num_layers):
            for j, kind in enumerate(("key_cache", "value_cache")):
                name = f"{kind}.{layer}"
                self._aliasing_report(name)
                ptr = base + (2 * layer + j) * pool_bytes
                self.pool_pointers[name] = ptr
                self._set_shape(name, self.pool_shape)
                self._bind(name, ptr)
                self._bind(pool_output_name(name), ptr)  # the aliased output: the SAME address (in place)

    def _allocate_step_buffers(self) -> None:
        info = self.info
        capacity = {
            "input_ids": info.max_num_tokens, "position_ids": info.max_num_tokens, "slot_mapping": info.max_num_tokens,
            "cumulative_sequence_length": info.max_num_seqs + 1, "past_seqlens": info.max_num_seqs,
            "block_table": info.max_num_seqs * info.max_blocks_per_seq, "logits_indices": info.max_num_logits,
        }
        self._inputs = {name: self._malloc(n * np.dtype(STEP_DTYPES[name]).itemsize) for name, n in capacity.items()}
        self._logits = self._malloc(info.max_num_logits * self.vocab_size * 4)
        self._bind("logits", self._logits)

    # ---- one step -----------------------------------------------------------------------------------
    def _check_limits(self, inputs: StepInputs) -> None:
        info = self.info
        t, b, n = len(inputs.input_ids), len(inputs.past_seqlens), len(inputs.logits_indices)
        width = inputs.block_table.shape[1] if inputs.block_table.ndim == 2 else -1
        problems = [
            f"{t} tokens > max_num_tokens {info.max_num_tokens}" if not 1 <= t <= info.max_num_tokens else "",
            f"{b} sequences > max_num_seqs {info.max_num_seqs}" if not 1 <= b <= info.max_num_seqs else "",
            f"{n} logits rows > max_num_logits {info.max_num_logits}" if not 1 <= n <= info.max_num_logits else "",
            f"block table width {width} > {info.max_blocks_per_seq}" if not 1 <= width <= info.max_blocks_per_seq else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise InvalidRequestError("step exceeds the TensorRT engine's build limits: " + "; ".join(problems)
                                      + " (rebuild with larger --max-* options)")

    def run(self, inputs: StepInputs) -> np.ndarray:
        """One step: copy the metadata in, enqueue the engine, copy the N logits rows back (float32)."""
        self._check_limits(inputs)
        cudart = self._cudart
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        keep_alive = []
        try:
            for name, dtype in STEP_DTYPES.items():
                array = np.ascontiguousarray(getattr(inputs, name), dtype=dtype)
                keep_alive.append(array)
                check(cudart.cudaMemcpyAsync(self._inputs[name], array.ctypes.data, array.nbytes, h2d, self._stream),
                      f"cudaMemcpyAsync({name})")
                self._set_shape(name, array.shape)
                self._bind(name, self._inputs[name])
            if not self.context.execute_async_v3(int(self._stream)):
                raise StepFailedError("TensorRT execute_async_v3 failed (see TensorRT's log above)")
            n = len(inputs.logits_indices)
            logits = np.empty((n, self.vocab_size), np.float32)
            check(cudart.cudaMemcpyAsync(logits.ctypes.data, self._logits, logits.nbytes,
                                         cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream), "cudaMemcpyAsync(logits)")
            check(cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        except RuntimeError as exc:
            raise StepFailedError(f"TensorRT step failed: {exc}") from exc
        return logits

    def read_pool(self, name: str) -> np.ndarray:
        """Copy one pool to the host (tests, debugging): float32/float16 arrays, bfloat16 as raw uint16."""
        view = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self.info.dtype]
        host = np.empty(self.pool_shape, view)
        check(self._cudart.cudaMemcpy(host.ctypes.data, self.pool_pointers[name], host.nbytes,
                                      self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy(pool)")
        return host

    def close(self) -> None:
        cudart = getattr(self, "_cudart", None)
        if cudart is None:
            return
        if getattr(self, "_stream", None) is not None:
            cudart.cudaStreamSynchronize(self._stream)
        while self._buffers:
            cudart.cudaFree(self._buffers.pop().ptr)
        if getattr(self, "_stream", None) is not None:
            cudart.cudaStreamDestroy(self._stream)
            self._stream = None
        self.context = None
        self.engine = None
