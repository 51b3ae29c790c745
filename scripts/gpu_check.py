#!/usr/bin/env python3
"""ONE short check of octavo's GPU path on a machine with an NVIDIA GPU and torch (< 4 min on an H200).

1. correctness: the OpenAI-Triton paged-attention kernel on the GPU vs the numpy reference
   (prefill, chunked prefill, decode, GQA, sliding window; fp32 / fp16 / bf16; block sizes 16 and 64);
2. decode bandwidth: GB/s of K/V streamed by the kernel vs the card's peak, and vs a peer in the same run
   (torch scaled_dot_product_attention over the same K/V laid out densely, no paging);
3. if TensorRT (+ cuda-python) is importable: build a tiny fp32 engine from a random llama exported by
   octavo, run a prefill and a decode step, compare logits with HF transformers.

Usage: python scripts/gpu_check.py [OUT.json]   (default: $OUT/gpu_check.json, else ./gpu_check.json)
Prints a compact summary; exit code 0 only if every check that could run passed.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

# Peak DRAM bandwidth (GB/s, vendor datasheets) by a substring of torch's device name; first match wins.
PEAK_GBPS = [
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("H800", 3350.0),
    ("GH200", 4000.0), ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("A800", 2039.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0),
    ("A10", 600.0), ("T4", 320.0), ("V100", 900.0), ("RTX 4090", 1008.0), ("RTX 3090", 936.0),
]
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


def peak_bandwidth(torch) -> tuple[float | None, str]:  # noqa: ANN001
    props = torch.cuda.get_device_properties(0)
    for key, gbps in PEAK_GBPS:
        if key in props.name:
            return gbps, f"table entry {key!r}"
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:  # double data rate
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    return None, "unknown device (no table entry, no clock/bus properties)"


def make_inputs(torch, dtype, heads, kv_heads, head_dim, block_size, seqs, seed=0):  # noqa: ANN001, ANN201
    """Random step on the GPU with a shuffled block table; seqs = [(past, new), ...]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [(p + n + block_size - 1) // block_size for p, n in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots, used = [], 0
    for b, ((past, new), k) in enumerate(zip(seqs, need)):
        table[b, :k] = perm[used:used + k]
        used += k
        slots += [int(table[b, pos // block_size]) * block_size + pos % block_size for pos in range(past, past + new)]
    t = sum(n for _, n in seqs)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    cpu = {
        "query": rnd(t, heads * head_dim), "key": rnd(t, kv_heads * head_dim), "value": rnd(t, kv_heads * head_dim),
        "key_cache": rnd(num_blocks, block_size, kv_heads, head_dim),
        "value_cache": rnd(num_blocks, block_size, kv_heads, head_dim),
        "cumulative_sequence_length": torch.tensor([0] + list(np.cumsum([n for _, n in seqs])), dtype=torch.int32),
        "past_seqlens": torch.tensor([p for p, _ in seqs], dtype=torch.int32),
        "block_table": table, "slot_mapping": torch.tensor(slots, dtype=torch.int64),
    }
    return cpu


KERNEL_CASES = [  # name, dtype, heads, kv_heads, head_dim, block, seqs [(past, new)], window
    ("prefill_gqa", "float16", 32, 8, 128, 16, [(0, 200), (0, 37), (0, 1)], 0),
    ("chunked_prefill", "bfloat16", 32, 8, 128, 16, [(256, 128), (40, 64)], 0),
    ("decode_batch", "float16", 32, 8, 128, 16, [(p, 1) for p in (1, 15, 16, 17, 300, 1023, 2000, 64)], 0),
    ("mixed_block64", "float16", 16, 2, 64, 64, [(500, 1), (0, 77), (130, 33)], 0),
    ("mha_fp32", "float32", 8, 8, 64, 16, [(100, 20), (7, 1)], 0),
    ("window_fp32", "float32", 8, 2, 64, 16, [(300, 40), (90, 1)], 32),
    ("decode_bf16_group8", "bfloat16", 64, 8, 128, 16, [(p, 1) for p in (33, 700, 4000)], 0),
]
SMOKE_CASES = [  # --smoke-cpu: the same code path on tiny shapes under TRITON_INTERPRET=1
    ("smoke_prefill", "float16", 4, 2, 16, 16, [(0, 5), (3, 2)], 0),
    ("smoke_decode_bf16", "bfloat16", 4, 1, 16, 16, [(20, 1), (2, 1)], 0),
    ("smoke_window_fp32", "float32", 4, 2, 16, 16, [(18, 3)], 5),
]


def check_kernel(torch, device: str = "cuda", cases: list = KERNEL_CASES) -> list[dict]:  # noqa: ANN001, B006
    from octavo.kernels.reference import paged_attention_ref
    from octavo.kernels.triton_paged_attention import paged_attention

    rows = []
    for name, dtype, heads, kv_heads, head_dim, block, seqs, window in cases:
        tdtype = getattr(torch, dtype)
        cpu = make_inputs(torch, tdtype, heads, kv_heads, head_dim, block, seqs)
        ref_in = {k: (v.float().numpy().copy() if v.is_floating_point() else v.numpy()) for k, v in cpu.items()}
        scale = 1.0 / math.sqrt(head_dim)
        expected = paged_attention_ref(*ref_in.values(), num_heads=heads, kv_num_heads=kv_heads, scale=scale,
                                       sliding_window=window)
        gpu = {k: v.to(device) for k, v in cpu.items()}
        out = paged_attention(*gpu.values(), num_heads=heads, kv_num_heads=kv_heads, scale=scale, sliding_window=window)
        if device == "cuda":
            torch.cuda.synchronize()
        err = float(np.abs(out.float().cpu().numpy() - expected).max())
        cache_err = max(float(np.abs(gpu[k].float().cpu().numpy() - ref_in[k]).max()) for k in ("key_cache", "value_cache"))
        ok = err <= TOLERANCE[dtype] and cache_err == 0.0 and bool(torch.isfinite(out.float()).all())
        rows.append({"case": name, "dtype": dtype, "max_abs_err": err, "tolerance": TOLERANCE[dtype],
                     "cache_max_abs_err": cache_err, "ok": ok})
    return rows


def bench_decode(torch, batch=64, context=2048, heads=32, kv_heads=8, head_dim=128, block=16, iters=50) -> dict:  # noqa: ANN001
    """Decode attention: every sequence reads `context` cached K and V rows. GB/s = K/V bytes / time."""
    import torch.nn.functional as F

    from octavo.kernels.triton_paged_attention import paged_attention

    dtype = torch.float16
    cpu = make_inputs(torch, dtype, heads, kv_heads, head_dim, block, [(context - 1, 1)] * batch, seed=1)
    gpu = {k: v.cuda() for k, v in cpu.items()}
    scale = 1.0 / math.sqrt(head_dim)

    def ours() -> None:
        paged_attention(*gpu.values(), num_heads=heads, kv_num_heads=kv_heads, scale=scale)

    # peer: the same K/V, dense [B, kv_heads, ctx, D] (no block table), torch SDPA with GQA expansion
    k_dense = torch.randn(batch, kv_heads, context, head_dim, device="cuda", dtype=dtype)
    v_dense = torch.randn_like(k_dense)
    q_dense = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=dtype)

    def peer() -> None:
        F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale, enable_gqa=True)

    def timed(fn) -> float:  # noqa: ANN001
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters / 1e3

    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    t_ours, t_peer = timed(ours), timed(peer)
    peak, peak_source = peak_bandwidth(torch)
    gbps = kv_bytes / t_ours / 1e9
    return {
        "shape": dict(batch=batch, context=context, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block, dtype="float16"),
        "kv_bytes": kv_bytes, "kernel_us": t_ours * 1e6, "kernel_gbps": gbps,
        "peer_sdpa_dense_us": t_peer * 1e6, "peer_sdpa_dense_gbps": kv_bytes / t_peer / 1e9,
        "kernel_over_peer_time": t_ours / t_peer,
        "peak_gbps": peak, "peak_source": peak_source, "fraction_of_peak": (gbps / peak) if peak else None,
    }


def check_tensorrt(torch) -> dict:  # noqa: ANN001
    try:
        import tensorrt
    except ImportError as exc:
        return {"status": "skipped", "reason": f"TensorRT not installed ({exc})"}
    from models import load_hf, make_random_model

    from octavo.build.tensorrt_builder import TensorRTBuildOptions, build_engine
    from octavo.export.exporter import export_model
    from octavo.runtime.backends.base import StepInputs
    from octavo.runtime.backends.tensorrt import TensorRTBackend

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_random_model(Path(tmp) / "hf", "llama")
        folder = Path(tmp) / "export"
        manifest = export_model(hf_dir, folder, progress=False)
        result: dict = {"tensorrt_version": tensorrt.__version__}
        for dtype, rel_tol in (("float32", 1e-4), ("float16", 2e-2)):
            build_engine(folder, TensorRTBuildOptions(dtype=dtype, max_num_tokens=64, max_num_seqs=4, max_num_blocks=64))
            backend = TensorRTBackend(folder, manifest, num_blocks=16)
            model, _ = load_hf(hf_dir)
            prompt = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 1, 30, 77, 120, 9, 14, 200, 6]
            table = np.array([[3, 9]], np.int32)
            slots = lambda ps: np.array([table[0, p // 16] * 16 + p % 16 for p in ps], np.int64)  # noqa: E731
            n = len(prompt)
            got1 = backend.run(StepInputs(np.array(prompt, np.int64), np.arange(n, dtype=np.int64), np.array([0, n], np.int32),
                                          np.array([0], np.int32), table, slots(range(n)), np.array([n - 1], np.int64)))
            nxt = int(got1[0].argmax())
            got2 = backend.run(StepInputs(np.array([nxt], np.int64), np.array([n], np.int64), np.array([0, 1], np.int32),
                                          np.array([n], np.int32), table, slots([n]), np.array([0], np.int64)))
            backend.close()
            with torch.no_grad():
                ref = model(torch.tensor([prompt + [nxt]])).logits[0].numpy()
            scale = float(np.abs(ref[n - 1:n + 1]).max())
            e1, e2 = float(np.abs(got1[0] - ref[n - 1]).max()), float(np.abs(got2[0] - ref[n]).max())
            same = bool(got1[0].argmax() == ref[n - 1].argmax() and got2[0].argmax() == ref[n].argmax())
            result[dtype] = {"prefill_max_abs_err": e1, "decode_max_abs_err": e2, "logit_scale": scale,
                             "rel_tol": rel_tol, "argmax_equal": same,
                             "ok": same and max(e1, e2) <= rel_tol * max(1.0, scale)}
        result["status"] = "ok" if all(result[d]["ok"] for d in ("float32", "float16")) else "failed"
        result["seconds"] = time.perf_counter() - started
        return result


def smoke_cpu() -> int:
    """Run the kernel-correctness section on CPU under TRITON_INTERPRET=1 (checks this script's own code)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    rows = check_kernel(torch, device="cpu", cases=SMOKE_CASES)
    for row in rows:
        print(json.dumps(row))
    return 0 if all(r["ok"] for r in rows) else 1


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--smoke-cpu"]:
        return smoke_cpu()
    out_path = Path(args[0]) if args else Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    report: dict = {"python": platform.python_version(), "started": time.time()}
    try:
        import torch
        import triton
    except ImportError as exc:
        print(f"gpu_check: needs torch and triton: {exc}")
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch")
        return 2
    props = torch.cuda.get_device_properties(0)
    report["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                        "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
                        "triton": triton.__version__, "cuda": torch.version.cuda}
    ok = True
    for key, fn in (("kernel", check_kernel), ("decode_bandwidth", bench_decode), ("tensorrt", check_tensorrt)):
        t0 = time.perf_counter()
        try:
            report[key] = fn(torch)
        except Exception as exc:  # report and go on: one failed section must not hide the others
            report[key] = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        report[f"{key}_seconds"] = round(time.perf_counter() - t0, 2)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")

    d = report["device"]
    print(f"device: {d['name']} (sm_{d['capability'].replace('.', '')}, {d['memory_gib']} GiB), torch {d['torch']}, triton {d['triton']}")
    kernel = report["kernel"]
    if isinstance(kernel, list):
        for row in kernel:
            ok &= row["ok"]
            print(f"  kernel {row['case']:<20} {row['dtype']:<9} err {row['max_abs_err']:.2e} (tol {row['tolerance']:.0e}) "
                  f"cache {'exact' if row['cache_max_abs_err'] == 0 else 'WRONG'}  {'ok' if row['ok'] else 'FAIL'}")
    else:
        ok = False
        print(f"  kernel: ERROR {kernel['error']}")
    bw = report["decode_bandwidth"]
    if "kernel_gbps" in bw:
        frac = f"{bw['fraction_of_peak']:.0%} of {bw['peak_gbps']:.0f} GB/s ({bw['peak_source']})" if bw["peak_gbps"] else bw["peak_source"]
        print(f"  decode B={bw['shape']['batch']} ctx={bw['shape']['context']}: {bw['kernel_us']:.0f} us, {bw['kernel_gbps']:.0f} GB/s = {frac}; "
              f"peer torch SDPA (dense, unpaged) {bw['peer_sdpa_dense_us']:.0f} us -> ours/peer time {bw['kernel_over_peer_time']:.2f}x")
    else:
        ok = False
        print(f"  decode bandwidth: ERROR {bw.get('error')}")
    trt = report["tensorrt"]
    if trt.get("status") == "skipped":
        print(f"  tensorrt: skipped ({trt['reason']})")
    elif trt.get("status") == "ok" or trt.get("status") == "failed":
        ok &= trt["status"] == "ok"
        for dt in ("float32", "float16"):
            r = trt[dt]
            print(f"  tensorrt {dt}: prefill err {r['prefill_max_abs_err']:.2e}, decode err {r['decode_max_abs_err']:.2e} "
                  f"(tol {r['rel_tol']} x {max(1.0, r['logit_scale']):.1f}), argmax equal {r['argmax_equal']} {'ok' if r['ok'] else 'FAIL'}")
    else:
        ok = False
        print(f"  tensorrt: ERROR {trt.get('error')}")
    print(f"{'PASS' if ok else 'FAIL'}; details in {out_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
