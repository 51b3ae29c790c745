#!/usr/bin/env python3
"""ONE prepared check of octavo's GPU path (one command, about 5-7 min on an H100; --budget-s 330 by default).

Sections, each in its own process and each case isolated (an exception is recorded, the rest runs); the JSON
report is rewritten after every case, so a timeout still leaves everything measured so far:

1. env: device, driver, torch / triton / numpy / cuda-python / tensorrt versions.
2. kernel_jit: the Triton paged-attention kernel through its torch launcher (Triton's JIT) vs the numpy
   reference: prefill, chunked prefill, decode, GQA, MHA, sliding window, block 64; fp32 / fp16 / bf16;
   and a pool of more than 131,072 blocks whose sequences use the TOP block ids (element offsets past 2^31).
3. aot_launch: the PTX the TensorRT plugin hands TensorRT (`compile_for_aot` + `ptx_abi.plugin_ptx`: exactly
   15 parameters) loaded with the driver API (cuModuleLoadData) and launched with cuLaunchKernel as TensorRT's
   AOT launch does: the plugin's grid (cdiv(T, BLOCK_M) + B, kv_heads), block (num_warps * 32), dynamic shared
   memory, a 15-entry argument array (9 input pointers, 3 int32 extras, 3 output pointers), the input pool
   pointer == the output pool pointer. Same references and cases as 2, including the big pool.
4. tensorrt: only if TensorRT imports ("TensorRT: not available on this machine" otherwise, and PASS then
   covers only what ran): fp32 + fp16 engines of the carried tiny llama export, TensorRTBackend's aliasing
   report / probe step / device memory, step logits vs carried transformers logits, and a fresh-process
   `octavo generate --backend tensorrt` vs the carried CPU greedy completions (scripts/gpu_check_tensorrt.py).
5. bandwidth: decode (1 new token per sequence) over batch {1,16,64,256} x context {512, 4k, 32k}: GB/s of
   K/V read by the JIT kernel, by the AOT PTX, and by a device-to-device copy moving the same bytes, vs the
   card's datasheet peak.

Usage:
  python scripts/gpu_check.py --prepare out/gpu_check_inputs     # CPU machine: what section 4 carries in
  python scripts/gpu_check.py [--out OUT.json] [--budget-s 330] [--inputs out/gpu_check_inputs] [--sections ...]
  python scripts/gpu_check.py --smoke-cpu [--out OUT.json]   # sections 2 and 3's compile on CPU
Default OUT: $OUT/gpu_check.json, else ./gpu_check.json. Exit code 0 only if every check that ran passed.
Tolerates Triton 3.6/3.7, numpy 2.x, no cuda-python (ctypes on libcuda), no TensorRT.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

# Peak DRAM bandwidth (GB/s, vendor datasheets) by a substring of torch's device name; first match wins.
PEAK_GBPS = [
    ("GH200", 4000.0), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("H800", 3350.0),
    ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("A800", 2039.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0),
    ("A10", 600.0), ("T4", 320.0), ("V100", 900.0), ("RTX 4090", 1008.0), ("RTX 3090", 936.0),
]
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}
SECTIONS = ("env", "kernel_jit", "aot_launch", "tensorrt", "bandwidth")
DEFAULT_INPUTS = ROOT / "out" / "gpu_check_inputs"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    block: int
    seqs: tuple[tuple[int, int], ...]  # (past, new) per sequence
    window: int = 0
    pool_blocks: int = 0  # > 0: a pool this big, the sequences' blocks taken from its TOP ids


KERNEL_CASES = [
    Case("prefill_gqa", "float16", 32, 8, 128, 16, ((0, 200), (0, 37), (0, 1))),
    Case("chunked_prefill", "bfloat16", 32, 8, 128, 16, ((256, 128), (40, 64))),
    Case("decode_batch", "float16", 32, 8, 128, 16, tuple((p, 1) for p in (1, 15, 16, 17, 300, 1023, 2000, 64))),
    Case("mixed_block64", "float16", 16, 2, 64, 64, ((500, 1), (0, 77), (130, 33))),
    Case("mha_fp32", "float32", 8, 8, 64, 16, ((100, 20), (7, 1))),
    Case("window_fp32", "float32", 8, 2, 64, 16, ((300, 40), (90, 1)), window=32),
    Case("decode_bf16_group8", "bfloat16", 64, 8, 128, 16, tuple((p, 1) for p in (33, 700, 4000))),
    # 140,000 blocks x 16 x 8 x 128: element offsets of the top blocks exceed 2^31 (int32 would wrap)
    Case("big_pool_top_ids_fp16", "float16", 32, 8, 128, 16, ((3000, 1), (500, 40), (17, 1)), pool_blocks=140_000),
    Case("big_pool_top_ids_fp32", "float32", 32, 8, 128, 16, ((1200, 1), (64, 9)), pool_blocks=140_000),
]
SMOKE_CASES = [  # --smoke-cpu: the same code on tiny shapes under TRITON_INTERPRET=1
    Case("smoke_prefill", "float16", 4, 2, 16, 16, ((0, 5), (3, 2))),
    Case("smoke_decode_bf16", "bfloat16", 4, 1, 16, 16, ((20, 1), (2, 1))),
    Case("smoke_window_fp32", "float32", 4, 2, 16, 16, ((18, 3),), window=5),
    Case("smoke_big_pool_top_ids", "float32", 4, 2, 16, 16, ((40, 1), (3, 4)), pool_blocks=300),
]
BANDWIDTH_BATCHES = (1, 16, 64, 256)
BANDWIDTH_CONTEXTS = (512, 4096, 32768)


# ---- the report: rewritten after every case ------------------------------------------------------
@dataclass(slots=True)
class Report:
    path: Path
    deadline: float
    data: dict = field(default_factory=dict)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def case(self, section: str, name: str, fn: Callable[[], dict], min_left: float = 5.0) -> dict:
        """Run one case isolated; record its row (or its error, or 'skipped: time budget'); save."""
        rows = self.data.setdefault(section, {})
        if self.left() < min_left:
            rows[name] = {"status": "skipped", "reason": f"time budget ({self.left():.0f} s left)"}
        else:
            started = time.perf_counter()
            try:
                rows[name] = fn()
            except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
                rows[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()[-3000:]}
            rows[name]["seconds"] = round(time.perf_counter() - started, 2)
        self.save()
        return rows[name]


# ---- inputs and the reference --------------------------------------------------------------------
def make_case(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Host inputs (float32 / int) with a shuffled block table. The pool holds only the blocks the case
    uses ("compact"); `block_ids` maps compact block i to its id in the full pool (top ids for a big pool)."""
    rng = np.random.default_rng(seed)
    need = [(p + n + case.block - 1) // case.block for p, n in case.seqs]
    compact = sum(need) + 2
    perm = rng.permutation(compact)
    width = max(need)
    table = np.full((len(case.seqs), width), compact - 1, np.int32)
    slots: list[int] = []
    used = 0
    for b, ((past, new), k) in enumerate(zip(case.seqs, need)):
        table[b, :k] = perm[used:used + k]
        used += k
        slots += [int(table[b, pos // case.block]) * case.block + pos % case.block for pos in range(past, past + new)]
    t = sum(n for _, n in case.seqs)
    pool = (compact, case.block, case.kv_heads, case.head_dim)
    full = max(case.pool_blocks, compact)
    return {
        "query": rng.standard_normal((t, case.heads * case.head_dim), np.float32),
        "key": rng.standard_normal((t, case.kv_heads * case.head_dim), np.float32),
        "value": rng.standard_normal((t, case.kv_heads * case.head_dim), np.float32),
        "key_cache": rng.standard_normal(pool, np.float32), "value_cache": rng.standard_normal(pool, np.float32),
        "cumulative_sequence_length": np.concatenate([[0], np.cumsum([n for _, n in case.seqs])]).astype(np.int32),
        "past_seqlens": np.array([p for p, _ in case.seqs], np.int32),
        "block_table": table, "slot_mapping": np.array(slots, np.int64),
        "block_ids": np.arange(full - compact, full, dtype=np.int64),  # compact block i -> full-pool id
        "full_blocks": np.array(full, np.int64),
    }


def rounded(array: np.ndarray, dtype: str, torch) -> np.ndarray:  # noqa: ANN001
    """A copy of ARRAY as DTYPE would store it, back in float32 (what the kernel and the reference both
    see). Always a copy: for float32, torch's .to() is a no-op view and the reference would write the
    new K/V into the host pool the device pool is uploaded from, making the pool check vacuous."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(getattr(torch, dtype)).float().numpy().copy()


def reference(case: Case, host: dict[str, np.ndarray], torch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # noqa: ANN001
    """numpy reference on the dtype-rounded inputs: (output, key pool, value pool), compact pools."""
    from octavo.reference import paged_attention_ref

    r = {k: rounded(host[k], case.dtype, torch) for k in ("query", "key", "value", "key_cache", "value_cache")}
    out = paged_attention_ref(r["query"], r["key"], r["value"], r["key_cache"], r["value_cache"],
                              host["cumulative_sequence_length"], host["past_seqlens"], host["block_table"],
                              host["slot_mapping"], num_heads=case.heads, kv_num_heads=case.kv_heads,
                              scale=1.0 / math.sqrt(case.head_dim), sliding_window=case.window)
    return out, r["key_cache"], r["value_cache"]


@dataclass(slots=True)
class DeviceCase:
    """The case's tensors on DEVICE: full-size pools (compact blocks placed at block_ids), remapped
    block table and slots, so the kernel sees the big pool's ids."""

    tensors: dict[str, Any]
    block_ids: Any

    @classmethod
    def upload(cls, case: Case, host: dict[str, np.ndarray], torch, device: str) -> "DeviceCase":  # noqa: ANN001
        dtype = getattr(torch, case.dtype)
        ids = torch.from_numpy(host["block_ids"]).to(device)
        full = int(host["full_blocks"])
        shape = (full, case.block, case.kv_heads, case.head_dim)
        tensors: dict[str, Any] = {}
        for name in ("query", "key", "value"):
            tensors[name] = torch.from_numpy(host[name]).to(device=device, dtype=dtype)
        for name in ("key_cache", "value_cache"):
            pool = torch.zeros(shape, dtype=dtype, device=device)
            pool[ids] = torch.from_numpy(host[name]).to(device=device, dtype=dtype)
            tensors[name] = pool
        table = host["block_ids"][host["block_table"]]
        slots = host["slot_mapping"]
        slots = host["block_ids"][slots // case.block] * case.block + slots % case.block
        tensors["cumulative_sequence_length"] = torch.from_numpy(host["cumulative_sequence_length"]).to(device)
        tensors["past_seqlens"] = torch.from_numpy(host["past_seqlens"]).to(device)
        tensors["block_table"] = torch.from_numpy(table.astype(np.int32)).to(device)
        tensors["slot_mapping"] = torch.from_numpy(slots.astype(np.int64)).to(device)
        return cls(tensors, ids)

    def compare(self, case: Case, output, expected: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict:  # noqa: ANN001
        out, kc, vc = expected
        err = float(np.abs(output.float().cpu().numpy() - out).max()) if out.size else 0.0
        cache_err = max(float(np.abs(self.tensors[k][self.block_ids].float().cpu().numpy() - ref).max())
                        for k, ref in (("key_cache", kc), ("value_cache", vc)))
        finite = bool(output.float().isfinite().all())
        ok = finite and err <= TOLERANCE[case.dtype] and cache_err == 0.0
        return {"status": "ok" if ok else "failed", "dtype": case.dtype, "max_abs_err": err,
                "tolerance": TOLERANCE[case.dtype], "cache_max_abs_err": cache_err, "finite": finite,
                "pool_blocks": int(self.tensors["key_cache"].shape[0])}


# ---- section 2: the kernel through Triton's JIT --------------------------------------------------
def kernel_jit_case(case: Case, torch, device: str) -> dict:  # noqa: ANN001
    from octavo.tensorrt.gpu_kernel import paged_attention

    host = make_case(case)
    expected = reference(case, host, torch)
    dev = DeviceCase.upload(case, host, torch, device)
    t = dev.tensors
    out = paged_attention(t["query"], t["key"], t["value"], t["key_cache"], t["value_cache"],
                          t["cumulative_sequence_length"], t["past_seqlens"], t["block_table"], t["slot_mapping"],
                          num_heads=case.heads, kv_num_heads=case.kv_heads, scale=1.0 / math.sqrt(case.head_dim),
                          sliding_window=case.window)
    if device == "cuda":
        torch.cuda.synchronize()
    row = dev.compare(case, out, expected)
    del dev
    return row


# ---- section 3: the AOT PTX, launched like TensorRT -----------------------------------------------
class LibcudaDriver:
    """The few driver calls this script makes, through ctypes on libcuda.so (always present where a GPU
    is), for machines without cuda-python. Same calling convention as cuda.bindings.driver: every call
    returns (CUresult, value...)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.name = "ctypes libcuda.so.1 (cuda-python not installed)"

    def cuInit(self, flags: int):  # noqa: N802, ANN201
        return (self.lib.cuInit(ctypes.c_uint(flags)),)

    def cuDriverGetVersion(self):  # noqa: N802, ANN201
        version = ctypes.c_int()
        return self.lib.cuDriverGetVersion(ctypes.byref(version)), version.value

    def cuModuleLoadData(self, image: int):  # noqa: N802, ANN201
        module = ctypes.c_void_p()
        return self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_void_p(image)), module

    def cuModuleGetFunction(self, module, name: bytes):  # noqa: N802, ANN001, ANN201
        function = ctypes.c_void_p()
        return self.lib.cuModuleGetFunction(ctypes.byref(function), module, ctypes.c_char_p(name)), function

    def CUstream(self, value: int):  # noqa: N802, ANN201
        return ctypes.c_void_p(value)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params: int, extra: int):  # noqa: N802, ANN001, ANN201, PLR0913
        u = ctypes.c_uint
        return (self.lib.cuLaunchKernel(f, u(gx), u(gy), u(gz), u(bx), u(by), u(bz), u(shared), stream,
                                        ctypes.c_void_p(params), ctypes.c_void_p(extra)),)


def import_driver():  # noqa: ANN201
    """cuda-python's driver module (what the issue asks to launch through); ctypes on libcuda if absent."""
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]  # older cuda-python
        except ImportError:
            return LibcudaDriver()
    return driver


def _ok(result, what: str):  # noqa: ANN001, ANN202
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what}: CUDA error {int(err)} ({getattr(err, 'name', err)})")
    return values[0] if len(values) == 1 else (tuple(values) if values else None)


@dataclass(slots=True)
class AotKernel:
    """One compiled variant loaded through the driver API, as TensorRT loads the PTX the plugin gives it."""

    config: Any
    name: str
    ptx: str
    num_params: int
    raw_params: int  # what Triton's compile declared before plugin_ptx (17 with Triton >= 3.3)
    num_warps: int
    shared: int
    function: Any
    module: Any

    @classmethod
    def load(cls, config, arch: int, ptx_version: int | None) -> "AotKernel":  # noqa: ANN001
        from octavo.tensorrt.gpu_kernel import compile_for_aot
        from octavo.tensorrt.ptx_abi import entry_parameters, plugin_ptx

        driver = import_driver()
        compiled = compile_for_aot(config, arch=arch, ptx_version=ptx_version)
        name = compiled.metadata.name
        ptx = plugin_ptx(compiled.asm["ptx"], name)  # exactly what the plugin's aot_impl returns
        image = np.frombuffer(ptx.encode() + b"\0", np.uint8)
        module = _ok(driver.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
        function = _ok(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
        return cls(config, name, ptx, len(entry_parameters(ptx, name)), len(entry_parameters(compiled.asm["ptx"], name)),
                   compiled.metadata.num_warps, compiled.metadata.shared, function, module)

    def launch(self, tensors: dict[str, Any]) -> None:
        """cuLaunchKernel with TensorRT's AOT argument layout: one kernelParams entry per input, extra, output."""
        from octavo.tensorrt.kernel_launch import num_tiles

        driver = import_driver()
        t = tensors
        num_tokens, num_seqs = int(t["query"].shape[0]), int(t["past_seqlens"].shape[0])
        grid_x = num_tiles(num_tokens, num_seqs, self.config.block_m)  # the plugin's cdiv(T, BLOCK_M) + B
        grid_y = self.config.kv_num_heads
        pointers = [t[k].data_ptr() for k in ("query", "key", "value", "key_cache", "value_cache",
                                              "cumulative_sequence_length", "past_seqlens", "block_table",
                                              "slot_mapping")]
        extras = [num_tokens, num_seqs, int(t["block_table"].shape[1])]
        outputs = [t["output"].data_ptr(), t["key_cache"].data_ptr(), t["value_cache"].data_ptr()]  # pools aliased
        values: list[ctypes._SimpleCData] = [ctypes.c_uint64(p) for p in pointers]
        values += [ctypes.c_int32(x) for x in extras]
        values += [ctypes.c_uint64(p) for p in outputs]
        if len(values) != self.num_params:
            raise RuntimeError(f"{self.name} declares {self.num_params} parameters, the launch passes {len(values)}")
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        _ok(driver.cuLaunchKernel(self.function, grid_x, grid_y, 1, self.num_warps * 32, 1, 1, self.shared,
                                  driver.CUstream(0), ctypes.addressof(params), 0), "cuLaunchKernel")


def kernel_config(case: Case):  # noqa: ANN201
    from octavo.tensorrt.gpu_kernel import KernelConfig

    return KernelConfig(dtype=case.dtype, num_heads=case.heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim,
                        block_size=case.block, scale=1.0 / math.sqrt(case.head_dim), sliding_window=case.window)


def aot_launch_case(case: Case, torch, kernels: dict, arch: int, ptx_version: int | None) -> dict:  # noqa: ANN001
    config = kernel_config(case)
    if config not in kernels:
        kernels[config] = AotKernel.load(config, arch, ptx_version)
    kernel = kernels[config]
    host = make_case(case)
    expected = reference(case, host, torch)
    dev = DeviceCase.upload(case, host, torch, "cuda")
    dev.tensors["output"] = torch.full_like(dev.tensors["query"], float("nan"))
    kernel.launch(dev.tensors)
    torch.cuda.synchronize()
    row = dev.compare(case, dev.tensors["output"], expected)
    row.update(kernel=kernel.name, ptx_params=kernel.num_params, triton_ptx_params=kernel.raw_params,
               shared=kernel.shared, block_x=kernel.num_warps * 32)
    return row


# ---- section 4: decode bandwidth -----------------------------------------------------------------
def timed(torch, fn: Callable[[], None], budget_s: float = 0.25) -> float:  # noqa: ANN001
    """Seconds per call (CUDA events), after a warm-up; as many iterations as fit BUDGET_S (5..100)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    iters = int(min(100, max(5, budget_s / once)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def peak_bandwidth(torch) -> tuple[float | None, str]:  # noqa: ANN001
    props = torch.cuda.get_device_properties(0)
    for key, gbps in PEAK_GBPS:
        if key in props.name:
            return gbps, f"datasheet ({key})"
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:  # double data rate
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    return None, "unknown device"


def bandwidth_case(batch: int, context: int, torch, kernels: dict, arch: int, ptx_version: int | None) -> dict:  # noqa: ANN001
    from octavo.tensorrt.gpu_kernel import paged_attention

    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    dtype = torch.float16
    blocks_per_seq = context // block
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    free, _ = torch.cuda.mem_get_info()
    if 1.6 * kv_bytes > free:
        return {"status": "skipped", "reason": f"needs {1.6 * kv_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} free"}
    num_blocks = batch * blocks_per_seq
    pool_shape = (num_blocks, block, kv_heads, head_dim)
    t = {"query": torch.randn(batch, heads * head_dim, device="cuda", dtype=dtype),
         "key": torch.randn(batch, kv_heads * head_dim, device="cuda", dtype=dtype),
         "value": torch.randn(batch, kv_heads * head_dim, device="cuda", dtype=dtype),
         "key_cache": torch.empty(pool_shape, device="cuda", dtype=dtype).normal_(),
         "value_cache": torch.empty(pool_shape, device="cuda", dtype=dtype).normal_()}
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int64)
    t["block_table"] = perm.view(batch, blocks_per_seq).to(torch.int32)
    t["cumulative_sequence_length"] = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    t["past_seqlens"] = torch.full((batch,), context - 1, device="cuda", dtype=torch.int32)
    last = t["block_table"][:, -1].to(torch.int64)
    t["slot_mapping"] = last * block + (context - 1) % block
    t["output"] = torch.empty_like(t["query"])
    scale = 1.0 / math.sqrt(head_dim)

    def jit() -> None:
        paged_attention(t["query"], t["key"], t["value"], t["key_cache"], t["value_cache"],
                        t["cumulative_sequence_length"], t["past_seqlens"], t["block_table"], t["slot_mapping"],
                        num_heads=heads, kv_num_heads=kv_heads, scale=scale)

    case = Case("bandwidth", "float16", heads, kv_heads, head_dim, block, ())
    config = kernel_config(case)
    if config not in kernels:
        kernels[config] = AotKernel.load(config, arch, ptx_version)
    aot_kernel = kernels[config]

    def aot() -> None:
        aot_kernel.launch(t)

    # the copy moves the same DRAM traffic as the kernel reads: K pool -> a scratch of its size (read N/2 +
    # write N/2 = N bytes)
    scratch = torch.empty_like(t["key_cache"])

    def copy() -> None:
        scratch.copy_(t["key_cache"])

    peak, source = peak_bandwidth(torch)
    row: dict = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "peak_gbps": peak, "peak_source": source}
    for name, fn in (("jit", jit), ("aot", aot), ("copy", copy)):
        seconds = timed(torch, fn)
        gbps = kv_bytes / seconds / 1e9
        row[f"{name}_us"] = round(seconds * 1e6, 1)
        row[f"{name}_gbps"] = round(gbps, 1)
        row[f"{name}_of_peak"] = round(gbps / peak, 3) if peak else None
    row["aot_over_jit_time"] = round(row["aot_us"] / row["jit_us"], 3)
    row["status"] = "ok"
    del t, scratch
    torch.cuda.empty_cache()
    return row


# ---- driver --------------------------------------------------------------------------------------
def versions() -> dict:
    found: dict = {"python": platform.python_version(), "numpy": np.__version__}
    for module in ("torch", "triton", "tensorrt", "cuda.bindings", "cuda"):
        try:
            mod = __import__(module, fromlist=["_"])
            found[module] = getattr(mod, "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - absent or broken: both are facts worth recording
            found[module] = f"unavailable ({type(exc).__name__}: {str(exc)[:120]})"
    return found


def run_gpu(report: Report, sections: set[str], inputs: Path = DEFAULT_INPUTS) -> None:
    if sections == {"tensorrt"}:  # no torch: TensorRT, cuda-python and the carried inputs only
        import tempfile

        from gpu_check_tensorrt import run_section

        with tempfile.TemporaryDirectory() as tmp:
            run_section(report, inputs, Path(tmp))
        return
    import torch

    from octavo.tensorrt.cuda_api import ptx_version_cap

    data = report.data
    torch.zeros(1, device="cuda")  # creates the primary context and makes it current (the driver API uses it)
    props = torch.cuda.get_device_properties(0)
    arch = props.major * 10 + props.minor
    driver = import_driver()
    _ok(driver.cuInit(0), "cuInit")
    ptx_cap, driver_version = None, None
    try:  # the PTX ISA the driver can JIT, as the builder computes it
        raw = int(_ok(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
        driver_version = f"{raw // 1000}.{(raw % 1000) // 10}"
        ptx_cap = ptx_version_cap(driver_version)
    except Exception as exc:  # noqa: BLE001
        data.setdefault("notes", []).append(f"PTX ISA cap unknown ({type(exc).__name__}: {exc}); Triton's default used")
    data["env"] = {**versions(), "device": props.name, "capability": arch, "memory_gib": round(props.total_memory / 2**30, 1),
                   "torch_cuda": torch.version.cuda, "driver_cuda": driver_version, "ptx_version_cap": ptx_cap,
                   "driver_api": getattr(driver, "name", getattr(driver, "__name__", str(driver))), "status": "ok"}
    report.save()
    if "kernel_jit" in sections:
        for case in KERNEL_CASES:
            report.case("kernel_jit", case.name, lambda c=case: kernel_jit_case(c, torch, "cuda"))
    kernels: dict = {}
    if "aot_launch" in sections:
        for case in KERNEL_CASES:
            report.case("aot_launch", case.name, lambda c=case: aot_launch_case(c, torch, kernels, arch, ptx_cap),
                        min_left=20)
    if "bandwidth" in sections:
        for batch in BANDWIDTH_BATCHES:
            for context in BANDWIDTH_CONTEXTS:
                report.case("bandwidth", f"b{batch}_ctx{context}",
                            lambda b=batch, c=context: bandwidth_case(b, c, torch, kernels, arch, ptx_cap), min_left=15)


def interpreter_index_compat() -> str:
    """Triton < 3.7's interpreter converts a scalar tensor to an index with int() on its 1-element array,
    which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"): every
    loop with a runtime bound fails. Triton 3.7 squeezes first; do the same for older versions (this
    script's process only). Returns what was done, for the report."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or "squeeze" in inspect.getsource(original):
        return "not needed"

    def patched(tensor, scope) -> None:  # noqa: ANN001
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    return "patched Triton's interpreter __index__ (int of a 1-element array, numpy >= 2.4)"


def run_sections_isolated(report: Report, sections: list[str], inputs: Path = DEFAULT_INPUTS) -> None:
    """Each section in its own process, one after the other: a sticky CUDA error (an illegal address
    poisons the whole context) or a crash ends only that section. The child adds its rows to the same
    report file after every case; the parent reloads it after each child."""
    report.save()
    for section in sections:
        left = report.left()
        if left < 10:
            report.data[section] = {"status": "skipped", "reason": f"time budget ({left:.0f} s left)"}
            report.save()
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--sections", section,
               "--out", str(report.path), "--budget-s", str(left), "--inputs", str(inputs)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left + 60)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = "timeout", str(exc)[-3000:]
        report.data = json.loads(report.path.read_text())
        if rc != 0:
            rows = report.data.setdefault(section, {})
            if isinstance(rows, dict):
                rows["process"] = {"status": "error", "error": f"section process ended with {rc}: {tail}"}
        report.save()


def run_smoke_cpu(report: Report) -> None:
    """Section 2 on CPU under the interpreter, and section 3's AOT compile (no launch) in a child process
    without the interpreter (triton.compile needs the real JIT objects)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    report.data["env"] = {**versions(), "device": "cpu (TRITON_INTERPRET=1)", "status": "ok",
                          "interpreter_compat": interpreter_index_compat()}
    report.save()
    for case in SMOKE_CASES:
        report.case("kernel_jit", case.name, lambda c=case: kernel_jit_case(c, torch, "cpu"))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])

    def compile_only() -> dict:
        proc = subprocess.run([sys.executable, __file__, "--aot-compile-only"], capture_output=True, text=True,
                              env=env, timeout=max(30, int(report.left())))
        if proc.returncode != 0:
            return {"status": "error", "error": proc.stderr[-3000:]}
        return json.loads(proc.stdout.strip().splitlines()[-1])

    report.case("aot_launch", "compile_only_sm90", compile_only, min_left=30)
    from gpu_check_tensorrt import tensorrt_unavailable

    reason = tensorrt_unavailable()
    report.data["tensorrt"] = ({"status": "unavailable", "reason": reason} if reason else
                               {"status": "skipped", "reason": "--smoke-cpu does not build engines"})
    report.save()


def ptx_params_ok(ptx: str, compiled) -> bool:  # noqa: ANN001
    from octavo.tensorrt.ptx_abi import PLUGIN_PARAM_TYPES, entry_parameters

    return tuple(p.type for p in entry_parameters(ptx, compiled.metadata.name)) == PLUGIN_PARAM_TYPES


def aot_compile_only() -> int:
    """Child of --smoke-cpu: compile one variant for sm_90 like the plugin does; describe its PTX."""
    from octavo.tensorrt.gpu_kernel import compile_for_aot

    from octavo.tensorrt.ptx_abi import entry_parameters, plugin_ptx

    config = kernel_config(SMOKE_CASES[0])
    compiled = compile_for_aot(config, arch=90)
    ptx = plugin_ptx(compiled.asm["ptx"], compiled.metadata.name)  # what the plugin hands TensorRT
    loads = [line.split()[0] for line in ptx.splitlines() if line.strip().startswith(("ld.global", "cp.async.c"))]
    wide = [op for op in loads if ".v4." in op or ".v2." in op or op.startswith("cp.async")]
    row = {"kernel": compiled.metadata.name, "ptx_params": len(entry_parameters(ptx, compiled.metadata.name)),
           "triton_ptx_params": len(entry_parameters(compiled.asm["ptx"], compiled.metadata.name)),
           "shared": compiled.metadata.shared, "wide_loads": len(wide), "loads": len(loads),
           "status": "ok" if wide and compiled.metadata.shared <= 48 * 1024 and ptx_params_ok(ptx, compiled) else "failed"}
    print(json.dumps(row))
    return 0


def summarize(data: dict) -> tuple[bool, list[str]]:
    """(every check that RAN passed and something ran, report lines). The last line says what PASS covers and,
    when TensorRT was not there, that its build and engine were not checked."""
    lines, ok, ran = [], True, []
    env = data.get("env", {})
    lines.append(f"device: {env.get('device')} sm_{env.get('capability', '?')}, torch {env.get('torch')}, "
                 f"triton {env.get('triton')}, numpy {env.get('numpy')}, tensorrt {env.get('tensorrt')}")
    tensorrt_note = ""
    for section in SECTIONS[1:]:
        rows = data.get(section)
        if not isinstance(rows, dict):
            continue
        if "status" in rows and not isinstance(rows["status"], dict):  # a whole-section verdict
            if rows["status"] == "unavailable":
                tensorrt_note = rows["reason"]
                lines.append(f"  {section}: {rows['reason']}")
                continue
            lines.append(f"  {section}: {rows['status']} {rows.get('reason', rows.get('error', ''))}")
            ok &= rows["status"] in ("ok", "skipped")
            continue
        passed = total = 0
        for name, row in rows.items():
            status = row.get("status", "?")
            ok &= status in ("ok", "skipped")
            total += status != "skipped"
            passed += status == "ok"
            lines.append(f"  {section:<11} {name:<26} {status:<8} {_detail(section, row)}")
        if total:
            ran.append(f"{section} {passed}/{total}")
    ok &= bool(ran)
    verdict = f"{'PASS' if ok else 'FAIL'}: {', '.join(ran) or 'nothing ran'}"
    if tensorrt_note:
        verdict += f". {UNAVAILABLE_NOTE} — the engine build, plugin and TensorRT backend were NOT checked"
    lines.append(verdict)
    return ok, lines


UNAVAILABLE_NOTE = "TensorRT: not available on this machine"


def _detail(section: str, row: dict) -> str:
    status = row.get("status")
    if section == "bandwidth" and status == "ok":
        return (f"jit {row['jit_gbps']:.0f} GB/s, aot {row['aot_gbps']:.0f} GB/s, copy {row['copy_gbps']:.0f} GB/s"
                f" of {row['peak_gbps']} peak")
    if section == "tensorrt" and "aliasing_reported_count" in row:
        return (f"TensorRT reports {row['aliasing_reported_count']} pools aliased, in-place probe "
                f"{'ok' if row['in_place_verified'] else 'FAILED'}, engine memory {row['device_memory_bytes']} B, "
                f"{row['num_blocks']} blocks, err {row['prefill_max_abs_err']:.1e}/{row['decode_max_abs_err']:.1e}")
    if section == "tensorrt" and "build_seconds" in row:
        return (f"TensorRT {row['tensorrt_version']}: {row['build_seconds']} s, engine memory "
                f"{row['device_memory_bytes']} B vs {row['kv_pool_bytes_per_layer']} B pools/layer at "
                f"{row['max_num_blocks']} blocks (copies suspected: {row['copies_suspected']})")
    if section == "tensorrt" and "matched" in row:
        return f"octavo generate --backend tensorrt: {row['matched']} completions equal the CPU's"
    if "max_abs_err" in row:
        extra = f", ptx params {row['ptx_params']}" if "ptx_params" in row else ""
        return f"err {row['max_abs_err']:.2e} (tol {row['tolerance']:.0e}), cache err {row['cache_max_abs_err']}{extra}"
    if "ptx_params" in row:
        return f"ptx params {row['ptx_params']} (Triton's {row.get('triton_ptx_params')}), shared {row.get('shared')} B"
    return (row.get("error") or row.get("reason", ""))[:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting new cases after this")
    parser.add_argument("--inputs", type=Path, default=DEFAULT_INPUTS, help="what --prepare wrote (tensorrt section)")
    parser.add_argument("--prepare", type=Path, default=None, metavar="DIR",
                        help="CPU machine: write the tensorrt section's carried inputs to DIR and exit")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--smoke-cpu", action="store_true")
    parser.add_argument("--aot-compile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("legacy_out", nargs="?", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.aot_compile_only:
        return aot_compile_only()
    if args.prepare is not None:
        from gpu_check_tensorrt import prepare

        expected = prepare(args.prepare)
        print(f"prepared {args.prepare}: export/ and expected.json ({len(expected['cpu_texts'])} CPU completions)")
        return 0
    out = args.out or args.legacy_out or Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    report = Report(out, time.monotonic() + args.budget_s)
    if args.child:  # one section, adding its rows to the report the parent started
        report.data = json.loads(out.read_text())
        run_gpu(report, set(args.sections.split(",")), args.inputs)
        return 0
    report.data.update({"started_unix": time.time(), "argv": sys.argv[1:]})
    if args.smoke_cpu:
        run_smoke_cpu(report)
    else:
        try:
            import torch
        except ImportError as exc:
            print(f"gpu_check: needs torch: {exc}")
            return 2
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device visible to torch")
            return 2
        run_sections_isolated(report, [s for s in SECTIONS[1:] if s in args.sections.split(",")], args.inputs)
    report.data["finished_unix"] = time.time()
    ok, lines = summarize(report.data)
    report.data["pass"] = ok
    report.save()
    print("\n".join(lines))
    print(f"details in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
