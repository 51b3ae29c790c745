"""The OpenAI-Triton paged-attention kernel against the numpy reference, on CPU.

The kernel runs under TRITON_INTERPRET=1, which must be set before triton is first imported; so the
kernel runs in ONE subprocess (this file's `_worker`, started with that variable) that executes every
case and prints one JSON line per case. A subprocess is required, not just careful: octavo's own code
does not import triton in the pytest process, but torch does (measured: loading an HF model through
transformers imports torch._dynamo, whose utils import triton), so the interpreter mode of the pytest
process is decided by whichever test loads a model first.
A second subprocess (no interpreter) compiles the kernel ahead of time for sm_90 with no GPU present.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# find_spec, not importorskip: the pytest process itself must not import triton (interpreter mode is
# fixed at triton's first import)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (pip install triton)")

TESTS = Path(__file__).parent
ROOT = TESTS.parent

# name -> (dtype, num_heads, kv_heads, head_dim, block_size, [(past, new), ...], window, softcap, num_blocks)
CASES: dict[str, tuple] = {
    "prefill_fp32": ("float32", 4, 2, 16, 16, [(0, 7), (0, 3), (0, 1)], 0, 0.0, 12),
    "chunked_prefill_fp32": ("float32", 4, 2, 16, 16, [(16, 5), (9, 8)], 0, 0.0, 12),
    "decode_fp32": ("float32", 4, 2, 16, 16, [(5, 1), (16, 1), (33, 1), (0, 1)], 0, 0.0, 12),
    "mixed_batch_fp32": ("float32", 4, 2, 16, 16, [(20, 1), (0, 6), (14, 4), (31, 1)], 0, 0.0, 16),
    "mha_fp32": ("float32", 4, 4, 16, 16, [(3, 2), (0, 4)], 0, 0.0, 8),
    "gqa_group8_fp32": ("float32", 8, 1, 32, 16, [(17, 3), (40, 1)], 0, 0.0, 10),
    "sliding_window_fp32": ("float32", 4, 2, 16, 16, [(30, 4), (3, 5), (40, 1)], 7, 0.0, 16),
    "softcap_fp32": ("float32", 4, 2, 16, 16, [(10, 6)], 0, 3.0, 8),
    "block64_fp32": ("float32", 4, 2, 16, 64, [(70, 3), (0, 5), (63, 1)], 0, 0.0, 8),
    "block64_fp16": ("float16", 4, 2, 16, 64, [(70, 3), (5, 1)], 0, 0.0, 8),
    "decode_fp16": ("float16", 4, 2, 32, 16, [(21, 1), (40, 1)], 0, 0.0, 10),
    "prefill_bf16": ("bfloat16", 4, 2, 16, 16, [(0, 5), (17, 2)], 0, 0.0, 8),
    "empty_sequence_in_batch_fp32": ("float32", 4, 2, 16, 16, [(5, 0), (3, 2), (0, 0), (17, 1)], 0, 0.0, 8),
    "tiny_block4_fp32": ("float32", 4, 2, 8, 4, [(0, 5), (7, 1)], 0, 0.0, 12),
    # more sequences than the kernel's 64-wide sequence scan: the tile -> sequence search crosses chunks
    "many_seqs_mixed_fp32": ("float32", 4, 2, 16, 16, [(i * 7 % 37, 4 if i % 9 == 0 else 1) for i in range(70)],
                             0, 0.0, 220),
}
# |kernel - reference| bound per dtype: inputs are identical (rounded to the dtype first); what differs is
# float32 accumulation vs float64, the P cast before P@V and the output rounding.
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def make_case(dtype: str, num_heads: int, kv_heads: int, head_dim: int, block_size: int,
              seqs: list[tuple[int, int]], num_blocks: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs with SHUFFLED block tables (physical blocks are a permutation, not 0,1,2...)."""
    rng = np.random.default_rng(seed)
    num_tokens = sum(n for _, n in seqs)
    width = max((p + n + block_size - 1) // block_size for p, n in seqs)
    perm = rng.permutation(num_blocks)
    table = np.full((len(seqs), width), num_blocks - 1, np.int32)  # unused entries point at a real block
    used = 0
    slots: list[int] = []
    for b, (past, new) in enumerate(seqs):
        need = (past + new + block_size - 1) // block_size
        assert used + need <= num_blocks, "case needs more blocks"
        table[b, :need] = perm[used:used + need]
        used += need
        slots += [int(table[b, pos // block_size]) * block_size + pos % block_size for pos in range(past, past + new)]
    pool_shape = (num_blocks, block_size, kv_heads, head_dim)
    return {
        "query": rng.standard_normal((num_tokens, num_heads * head_dim)).astype(np.float32),
        "key": rng.standard_normal((num_tokens, kv_heads * head_dim)).astype(np.float32),
        "value": rng.standard_normal((num_tokens, kv_heads * head_dim)).astype(np.float32),
        "key_cache": rng.standard_normal(pool_shape).astype(np.float32),
        "value_cache": rng.standard_normal(pool_shape).astype(np.float32),
        "cumulative_sequence_length": np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32),
        "past_seqlens": np.array([p for p, _ in seqs], np.int32),
        "block_table": table,
        "slot_mapping": np.array(slots, np.int64),
    }


def run_case(name: str) -> dict:
    """Runs inside the interpreter subprocess: kernel vs reference on one case."""
    import torch

    from octavo.reference import paged_attention_ref
    from octavo.tensorrt.gpu_kernel import paged_attention

    dtype, heads, kv_heads, head_dim, block_size, seqs, window, softcap, num_blocks = CASES[name]
    arrays = make_case(dtype, heads, kv_heads, head_dim, block_size, seqs, num_blocks)
    tdtype = getattr(torch, dtype)
    fp = {k: torch.from_numpy(arrays[k]).to(tdtype) for k in ("query", "key", "value", "key_cache", "value_cache")}
    # the reference sees exactly the dtype-rounded values the kernel sees
    ref_in = {k: v.float().numpy().copy() for k, v in fp.items()}
    scale = 1.0 / np.sqrt(head_dim)
    ints = {k: arrays[k] for k in ("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping")}
    expected = paged_attention_ref(
        ref_in["query"], ref_in["key"], ref_in["value"], ref_in["key_cache"], ref_in["value_cache"],
        *ints.values(), num_heads=heads, kv_num_heads=kv_heads, scale=scale, sliding_window=window, softcap=softcap,
    )
    got = paged_attention(
        fp["query"], fp["key"], fp["value"], fp["key_cache"], fp["value_cache"],
        *(torch.from_numpy(v) for v in ints.values()),
        num_heads=heads, kv_num_heads=kv_heads, scale=scale, sliding_window=window, softcap=softcap,
    )
    cache_err = max(float(np.abs(fp[k].float().numpy() - ref_in[k]).max()) for k in ("key_cache", "value_cache"))
    return {
        "name": name,
        "max_abs_err": float(np.abs(got.float().numpy() - expected).max()),
        "cache_max_abs_err": cache_err,
        "output_dtype": str(got.dtype),
        "finite": bool(torch.isfinite(got.float()).all()),
    }


def _worker() -> None:
    for name in CASES:
        print(json.dumps(run_case(name)), flush=True)


def _subprocess(code: str, interpret: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    # cold Triton compiles of several variants take minutes on a loaded 2-core machine
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    proc = _subprocess("import test_triton_kernel as t; t._worker()", interpret=True)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["name"]] = row
    if proc.returncode != 0:
        pytest.fail(f"interpreter worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_under_interpreter(interpreter_results: dict[str, dict], name: str) -> None:
    row = interpreter_results[name]
    dtype = CASES[name][0]
    assert row["finite"]
    assert row["output_dtype"] == f"torch.{dtype}"
    assert row["cache_max_abs_err"] == 0.0, "new K/V must land in the pool bit-exactly at slot_mapping"
    assert row["max_abs_err"] <= TOLERANCE[dtype], row


def test_reference_is_not_trivially_matched() -> None:
    """Sanity: the cases are sensitive — dropping the cached prefix changes the reference output."""
    from octavo.reference import paged_attention_ref

    dtype, heads, kv_heads, head_dim, block_size, seqs, window, softcap, num_blocks = CASES["chunked_prefill_fp32"]
    a = make_case(dtype, heads, kv_heads, head_dim, block_size, seqs, num_blocks)
    b = {k: v.copy() for k, v in a.items()}
    b["key_cache"][:] = 0.0  # forget the cached prefix
    kw = dict(num_heads=heads, kv_num_heads=kv_heads, scale=0.25)
    out_a = paged_attention_ref(*a.values(), **kw)
    out_b = paged_attention_ref(*b.values(), **kw)
    assert np.abs(out_a - out_b).max() > 10 * TOLERANCE["float32"]


AOT_CODE = """
import json
from octavo.tensorrt.gpu_kernel import KernelConfig, compile_kernel, check_aot_launchable
from octavo.tensorrt.ptx_abi import entry_parameters, plugin_ptx
rows = []
for dtype in ("float16", "bfloat16", "float32"):
    c = compile_kernel(KernelConfig(dtype=dtype, num_heads=8, kv_num_heads=2, head_dim=64, block_size=16,
                                    scale=0.125, sliding_window=0), arch=90)
    check_aot_launchable(c)
    ptx = c.asm["ptx"]
    entry = ptx[ptx.index(".entry"):ptx.index(")", ptx.index(".entry"))]
    params = [line.split()[1].lstrip(".") for line in entry.splitlines() if line.strip().startswith(".param")]
    for_tensorrt = plugin_ptx(ptx, c.metadata.name)
    loads = [l.split()[0] for l in ptx.splitlines() if l.strip().startswith(("ld.global", "cp.async.cg", "cp.async.ca"))]
    rows.append({"dtype": dtype, "name": c.metadata.name, "ptx_target": [l for l in ptx.splitlines()
                 if l.startswith(".target")][0], "ptx_len": len(ptx), "cubin_len": len(c.asm["cubin"]),
                 "loads": loads,
                 "param_types": params, "shared": c.metadata.shared, "num_warps": c.metadata.num_warps,
                 "plugin_param_types": [p.type for p in entry_parameters(for_tensorrt, c.metadata.name)],
                 "plugin_ptx_differs_only_in_entry": for_tensorrt[for_tensorrt.index("{"):] == ptx[ptx.index("{"):],
                 "ptx": for_tensorrt if dtype == "float16" else ""})
from octavo.tensorrt.gpu_kernel import AOT_SHARED_LIMIT, compile_for_aot
fits = []
for dtype, head_dim in (("float32", 128), ("float16", 256)):
    c = compile_for_aot(KernelConfig(dtype=dtype, num_heads=8, kv_num_heads=1, head_dim=head_dim, block_size=16,
                                     scale=0.1), arch=90)
    fits.append({"dtype": dtype, "head_dim": head_dim, "shared": c.metadata.shared, "limit": AOT_SHARED_LIMIT})
rows[0]["fits"] = fits
print(json.dumps(rows))
"""


def test_kernel_compiles_ahead_of_time_for_sm90_without_gpu(tmp_path: Path) -> None:
    """triton.compile with GPUTarget('cuda', 90, 32): PTX (what TensorRT's AOT plugin takes) and a cubin."""
    proc = _subprocess(AOT_CODE, interpret=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in rows:
        assert row["ptx_target"].startswith(".target sm_90"), row["ptx_target"]
        assert row["ptx_len"] > 1000 and row["cubin_len"] > 1000
        # TensorRT's AOT launch ABI: 9 input pointers, 3 int32 extras, 3 output pointers; Triton's compile adds
        # its hidden scratch pointers after them, the PTX handed to TensorRT (plugin_ptx) declares exactly 15
        types = row["param_types"]
        assert types[:15] == ["u64"] * 9 + ["u32"] * 3 + ["u64"] * 3, types
        assert all(t == "u64" for t in types[15:]), types
        assert row["plugin_param_types"] == ["u64"] * 9 + ["u32"] * 3 + ["u64"] * 3, row["plugin_param_types"]
        assert row["plugin_ptx_differs_only_in_entry"]
        # the 16-byte divisibility hints on the pointers (aot_attrs) make K/V/Q loads 128-bit: vector loads or
        # cp.async copies, and no 2-/4-byte scalar element loads of the half/float tensors
        loads = row["loads"]
        wide = [op for op in loads if ".v4." in op or ".v2." in op or op.startswith("cp.async")]
        element = {"float16": ".b16", "bfloat16": ".b16", "float32": ".b32"}[row["dtype"]]
        scalar = [op for op in loads if op.startswith("ld.global") and ".v" not in op and op.endswith(element)]
        assert wide, (row["dtype"], loads[:20])
        assert len(scalar) <= 8, (row["dtype"], scalar[:20])  # a few scalar int32 metadata loads (cu, table) remain
    # the default variant of fp32 / head_dim 128 wants ~200 KB of shared memory (3-stage cp.async pipeline);
    # compile_for_aot falls back until it fits the 48 KiB a launch gets without an opt-in
    for fit in rows[0]["fits"]:
        assert 0 < fit["shared"] <= fit["limit"], fit
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if Path(ptxas).is_file():  # a second, independent assembler (the CUDA toolkit's) accepts the plugin's PTX
        ptx_file = tmp_path / "paged_attention.ptx"
        ptx_file.write_text(rows[0]["ptx"])
        done = subprocess.run([ptxas, "-arch=sm_90a", str(ptx_file), "-o", str(tmp_path / "k.cubin")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "k.cubin").stat().st_size > 1000
