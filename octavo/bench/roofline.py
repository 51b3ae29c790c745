"""Roofline: how close octavo's decode steps come to what this machine can do, measured in one run.

- sgemm peak:   numpy (OpenBLAS) fp32 2048^3 matmul, best of a few, on the same thread count.
- bandwidth:    numpy copy of a 256 MiB array (bytes read + bytes written per second), best of a few.
- large batch:  decode steps of `batch` sequences straight through OnnxRuntimeBackend; matmul FLOPs
                (2 x the weights of every Gemm in the graph x tokens) per second of step, as a share
                of the sgemm peak; and (a second session with ORT's profiler on) the share of kernel
                time per op type and the matmul FLOPs per second of Gemm kernel time alone.
These four are measured in interleaved rounds, best round each, so that load from other processes
(this machine is shared) hits them alike.
- batch 1:      weight bytes streamed per decode step / step time, as a share of the copy bandwidth.

    python -m octavo.bench.roofline EXPORT_DIR [--threads 2] [--batch 64] [--context 128] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from octavo.export.manifest import Manifest


@dataclass(slots=True)
class Roofline:
    threads: int
    sgemm_gflops: float
    copy_gbs: float
    matmul_weight_bytes: int  # float32 bytes of all Gemm weights (what one token multiplies through)
    batch: int
    context: int
    step_ms_batch: float
    achieved_gflops_batch: float  # matmul FLOPs / whole step time
    gemm_kernel_gflops_batch: float | None  # matmul FLOPs / Gemm kernel time (ORT profile)
    op_share_batch: dict[str, float] = field(default_factory=dict)  # op type -> share of kernel time
    step_ms_1: float = 0.0
    bandwidth_gbs_1: float = 0.0  # weight bytes / step time at batch 1

    @property
    def batch_vs_peak(self) -> float:
        return self.achieved_gflops_batch / self.sgemm_gflops

    @property
    def batch1_vs_copy(self) -> float:
        return self.bandwidth_gbs_1 / self.copy_gbs

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "batch_vs_peak": self.batch_vs_peak, "batch1_vs_copy": self.batch1_vs_copy}

    def lines(self) -> str:
        kern = (f", {self.gemm_kernel_gflops_batch:.1f} GFLOP/s inside the Gemm kernels "
                f"({self.gemm_kernel_gflops_batch / self.sgemm_gflops * 100:.0f}% of peak)"
                if self.gemm_kernel_gflops_batch else "")
        shares = ", ".join(f"{k} {v * 100:.0f}%" for k, v in sorted(self.op_share_batch.items(), key=lambda kv: -kv[1])[:4])
        return (f"roofline ({self.threads} threads): sgemm peak {self.sgemm_gflops:.1f} GFLOP/s, copy {self.copy_gbs:.1f} GB/s\n"
                f"  decode batch {self.batch} ctx {self.context}: {self.step_ms_batch:.1f} ms/step, matmuls at "
                f"{self.achieved_gflops_batch:.1f} GFLOP/s = {self.batch_vs_peak * 100:.0f}% of sgemm peak{kern}\n"
                f"  kernel time by op: {shares}\n"
                f"  decode batch 1: {self.step_ms_1:.2f} ms/step, {self.matmul_weight_bytes / 2**20:.0f} MiB of weights -> "
                f"{self.bandwidth_gbs_1:.1f} GB/s = {self.batch1_vs_copy * 100:.0f}% of copy bandwidth")


def sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def copy_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * nbytes / best / 1e9


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gemm_weight_elements(model_dir: Path, manifest: Manifest) -> int:
    """Elements of every Gemm/MatMul weight initializer (read from the graph, weights not loaded)."""
    import onnx

    model = onnx.load(str(model_dir / manifest.onnx_file), load_external_data=False)
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    total = 0
    for node in model.graph.node:
        if node.op_type in ("Gemm", "MatMul"):
            dims = shapes.get(node.input[1])
            if dims:
                total += int(np.prod(dims))
    return total


def _decode_inputs(batch: int, context: int, block_size: int, first_block: int = 0) -> Any:
    from octavo.runtime.backends.base import StepInputs

    per_seq = context // block_size + 1
    table = (first_block + np.arange(batch * per_seq, dtype=np.int32)).reshape(batch, per_seq)
    slots = table[:, context // block_size].astype(np.int64) * block_size + context % block_size
    return StepInputs(
        input_ids=np.arange(3, 3 + batch, dtype=np.int64), position_ids=np.full(batch, context, np.int64),
        cumulative_sequence_length=np.arange(batch + 1, dtype=np.int32), past_seqlens=np.full(batch, context, np.int32),
        block_table=table, slot_mapping=slots, logits_indices=np.arange(batch, dtype=np.int64))


def decode_step_seconds(backend: Any, batch: int, context: int, steps: int) -> float:
    """Median seconds of a decode step with BATCH sequences of CONTEXT cached tokens."""
    inputs = _decode_inputs(batch, context, backend.block_size)
    backend.run(inputs)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        backend.run(inputs)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def kernel_us_by_op(events: list[dict[str, Any]]) -> dict[str, float]:
    """Microseconds of kernel time per op type in an ORT profile's events."""
    agg: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            agg[ev["args"]["op_name"]] += ev["dur"]
    return dict(agg)


def measure(model_dir: Path, *, threads: int = 2, batch: int = 64, context: int = 128, steps: int = 10,
            block_size: int = 16, rounds: int = 3, small: bool = False) -> Roofline:
    """Peak, bandwidth and the two decode steps measured in interleaved rounds (load from elsewhere hits
    all of them alike); the best round of each counts."""
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    manifest = Manifest.load(model_dir)
    weights = gemm_weight_elements(model_dir, manifest)
    num_blocks = batch * (context // block_size + 1) + 1
    backend = OnnxRuntimeBackend(model_dir, manifest, num_blocks, block_size, num_threads=threads)
    rng = np.random.default_rng(0)
    for pool in (*backend.key_caches, *backend.value_caches):  # real data: no zero-page shortcuts
        pool[...] = rng.standard_normal(pool.shape, np.float32)
    peak, bw, t_big, t_one = 0.0, 0.0, float("inf"), float("inf")
    try:
        for _ in range(rounds):
            peak = max(peak, sgemm_gflops(512 if small else 2048, repeats=2))
            bw = max(bw, copy_gbs((32 if small else 256) << 20, repeats=2))
            t_big = min(t_big, decode_step_seconds(backend, batch, context, steps))
            t_one = min(t_one, decode_step_seconds(backend, 1, context, steps * 3))
    finally:
        backend.close()
    flops = 2.0 * weights * batch
    shares, kernel_gflops = _profiled_shares(model_dir, manifest, threads, batch, context, block_size, flops)
    return Roofline(threads, peak, bw, weights * 4, batch, context, t_big * 1e3, flops / t_big / 1e9, kernel_gflops,
                    shares, t_one * 1e3, weights * 4 / t_one / 1e9)


def _profiled_shares(model_dir: Path, manifest: Manifest, threads: int, batch: int, context: int, block_size: int,
                     flops: float) -> tuple[dict[str, float], float | None]:
    """A second backend with ORT's profiler on: op-type shares and the Gemm kernels' own GFLOP/s."""
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    steps = 5
    with tempfile.TemporaryDirectory() as tmp:
        backend = OnnxRuntimeBackend(model_dir, manifest, batch * (context // block_size + 1) + 1, block_size,
                                     num_threads=threads, profile_prefix=str(Path(tmp) / "ort"))
        try:
            inputs = _decode_inputs(batch, context, block_size)
            for _ in range(steps):
                backend.run(inputs)
            events = json.loads(Path(backend.session.end_profiling()).read_text())
        finally:
            backend.close()
    agg = kernel_us_by_op(events)
    total = sum(agg.values()) or 1.0
    gemm_us = sum(agg.get(k, 0.0) for k in ("Gemm", "MatMul", "FusedMatMul")) / steps
    return {k: v / total for k, v in agg.items()}, (flops / (gemm_us * 1e-6) / 1e9 if gemm_us else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="an octavo export folder")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--small", action="store_true", help="one round, small sgemm/copy sizes (a smoke run, not a peak)")
    args = p.parse_args(argv)
    r = measure(args.model, threads=args.threads, batch=args.batch, context=args.context, steps=args.steps,
                rounds=1 if args.small else 3, small=args.small)
    print(r.lines())
    if args.json:
        args.json.write_text(json.dumps(r.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
