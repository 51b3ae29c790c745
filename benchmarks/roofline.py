"""Roofline: how close octavo's decode steps come to what this machine can do, measured in one run.

- sgemm peak:   fp32 2048^3 matmul, best of a few, on the same thread count, by BOTH numpy (OpenBLAS) and
                ONNX Runtime's own Gemm (MLAS, the kernels octavo's steps run on); the faster of the two is the
                peak (on this project's 2-core EPYC MLAS is the faster one, so numpy alone flatters the ratio).
- bandwidth:    numpy copy of a 256 MiB array (bytes read + bytes written per second), best of a few.
- large batch:  decode steps of `batch` sequences straight through OnnxRuntimeBackend; matmul FLOPs
                (2 x the weights of every Gemm/MatMul/MatMulNBits/BlockMatMul in the graph x tokens; attention's own
                two matmuls, q.K^T and p.V over the context, are reported beside it, not in it) per second
                of step, as a share of the sgemm peak; and (a second session with ORT's profiler on) the share of kernel
                time per op type and the matmul FLOPs per second of the projections' own kernel time
                (Gemm, MatMul, FusedMatMul, MatMulNBits, BlockMatMul: MATMUL_KERNELS).
These four are measured in interleaved rounds, best round each, so that load from other processes
(this machine is shared) hits them alike.
- batch 1:      weight bytes streamed per decode step / step time, as a share of the copy bandwidth.
- more batches: `--extra-batches 128,256` measures the same large-batch line at other batch sizes in the
                same rounds (the main `--batch` stays the one the target is judged on).

    python -m benchmarks.roofline EXPORT_DIR [--threads 2] [--batch 64] [--context 128] [--json OUT]
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
    sgemm_gflops: float  # the peak: max(numpy, onnxruntime)
    copy_gbs: float
    matmul_weight_bytes: int  # bytes of all projection weights as stored (fp32, or codes + scales (+ zero points/offsets))
    batch: int
    context: int
    step_ms_batch: float
    achieved_gflops_batch: float  # matmul FLOPs / whole step time
    gemm_kernel_gflops_batch: float | None  # matmul FLOPs / the MATMUL_KERNELS' kernel time (ORT profile)
    op_share_batch: dict[str, float] = field(default_factory=dict)  # op type -> share of kernel time
    step_ms_1: float = 0.0
    bandwidth_gbs_1: float = 0.0  # weight bytes / step time at batch 1
    sgemm_by: dict[str, float] = field(default_factory=dict)  # implementation -> its 2048^3 GFLOP/s
    attention_gflops_batch: float = 0.0  # q.K^T + p.V FLOPs of the batch step / whole step time
    extra_batches: dict[int, float] = field(default_factory=dict)  # batch -> best step ms (--extra-batches)
    matmul_flops_per_token: float = 0.0  # 2 x projection weights

    def gflops_at(self, batch: int) -> float:
        return self.matmul_flops_per_token * batch / (self.extra_batches[batch] * 1e-3) / 1e9

    @property
    def batch_vs_peak(self) -> float:
        return self.achieved_gflops_batch / self.sgemm_gflops

    @property
    def batch1_vs_copy(self) -> float:
        return self.bandwidth_gbs_1 / self.copy_gbs

    def to_dict(self) -> dict[str, Any]:
        extra = {str(b): {"step_ms": ms, "gflops": self.gflops_at(b), "vs_peak": self.gflops_at(b) / self.sgemm_gflops}
                 for b, ms in self.extra_batches.items()}
        return {**asdict(self), "extra_batches": extra, "batch_vs_peak": self.batch_vs_peak,
                "batch1_vs_copy": self.batch1_vs_copy}

    def lines(self) -> str:
        kern = (f", {self.gemm_kernel_gflops_batch:.1f} GFLOP/s inside the matmul kernels "
                f"({self.gemm_kernel_gflops_batch / self.sgemm_gflops * 100:.0f}% of peak)"
                if self.gemm_kernel_gflops_batch else "")
        shares = ", ".join(f"{k} {v * 100:.0f}%" for k, v in sorted(self.op_share_batch.items(), key=lambda kv: -kv[1])[:4])
        by = ", ".join(f"{k} {v:.0f}" for k, v in self.sgemm_by.items())
        return (f"roofline ({self.threads} threads): sgemm peak {self.sgemm_gflops:.1f} GFLOP/s ({by}), "
                f"copy {self.copy_gbs:.1f} GB/s\n"
                f"  decode batch {self.batch} ctx {self.context}: {self.step_ms_batch:.1f} ms/step, weight matmuls at "
                f"{self.achieved_gflops_batch:.1f} GFLOP/s = {self.batch_vs_peak * 100:.0f}% of sgemm peak{kern} "
                f"(+ attention's q.K/p.V {self.attention_gflops_batch:.1f} GFLOP/s, not counted)\n"
                + "".join(f"  decode batch {b} ctx {self.context}: {ms:.1f} ms/step, weight matmuls at "
                          f"{self.gflops_at(b):.1f} GFLOP/s = {self.gflops_at(b) / self.sgemm_gflops * 100:.0f}% of sgemm peak\n"
                          for b, ms in self.extra_batches.items())
                + f"  kernel time by op (batch {self.batch}): {shares}\n"
                f"  decode batch 1: {self.step_ms_1:.2f} ms/step, {self.matmul_weight_bytes / 2**20:.0f} MiB of weights -> "
                f"{self.bandwidth_gbs_1:.1f} GB/s = {self.batch1_vs_copy * 100:.0f}% of copy bandwidth")


def sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def ort_sgemm_gflops(n: int = 2048, repeats: int = 5, threads: int = 2) -> float:
    """The same product through ONNX Runtime's Gemm (MLAS), B a graph input like A (nothing prepacked)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [n, n]) for name in ("a", "b")]
    graph = helper.make_graph([helper.make_node("Gemm", ["a", "b"], ["c"])], "sgemm", inputs,
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {"a": rng.random((n, n), np.float32), "b": rng.random((n, n), np.float32)}
    binding = session.io_binding()
    for name, value in feed.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("c")
    session.run_with_iobinding(binding)
    best = min(_timed(lambda: session.run_with_iobinding(binding)) for _ in range(repeats))
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


# quantized projections: op type -> the inputs that hold its weight as stored (the activations are input 0,
# a bias comes after these and is not counted). MatMulNBits: packed codes, scales, zero points;
# octavo.BlockMatMul (a GGUF's own blocks): codes, scales, offsets. Both carry K and N as attributes.
# the weight inputs of each quantized kernel (BlockMatMul's 6 and 7: the K-quants' two-level scales)
BLOCK_WEIGHT_INPUTS = {"MatMulNBits": (1, 2, 3), "BlockMatMul": (1, 2, 3, 6, 7)}
MATMUL_KERNELS = ("Gemm", "MatMul", "FusedMatMul", *BLOCK_WEIGHT_INPUTS)  # op types of the projections' kernel time


def gemm_weights(model_dir: Path, manifest: Manifest) -> tuple[int, int]:
    """(multiply-adds one token does through the projection weights, bytes those weights take as stored)
    over every Gemm/MatMul with a weight initializer, every MatMulNBits (packed weight + scales + zero
    points) and every octavo.BlockMatMul (codes + scales + offsets + two-level scales' supers; K x N multiply-adds, its zero-padded
    columns not counted); read from the graph, weights not loaded."""
    import onnx

    model = onnx.load(str(model_dir / manifest.onnx_file), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    size = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.UINT8: 1, onnx.TensorProto.INT8: 1}

    def stored(t: onnx.TensorProto) -> int:
        return int(np.prod(t.dims)) * size.get(t.data_type, 4)

    elements, nbytes = 0, 0
    for node in model.graph.node:
        if node.op_type in ("Gemm", "MatMul") and node.input[1] in inits:
            t = inits[node.input[1]]
            elements += int(np.prod(t.dims))
            nbytes += stored(t)
        elif node.op_type in BLOCK_WEIGHT_INPUTS:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            elements += int(attrs["K"]) * int(attrs["N"])
            names = [node.input[i] for i in BLOCK_WEIGHT_INPUTS[node.op_type] if i < len(node.input)]
            nbytes += sum(stored(inits[name]) for name in names if name in inits)
    return elements, nbytes


def attention_flops(manifest: Manifest, batch: int, context: int) -> float:
    """q.K^T and p.V of one decode step: 2 matmuls x 2 FLOPs x (context + 1) keys x head_dim per query head."""
    return 4.0 * batch * (context + 1) * manifest.num_heads * manifest.head_dim * manifest.num_layers


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
            block_size: int = 16, rounds: int = 3, small: bool = False,
            extra_batches: tuple[int, ...] = ()) -> Roofline:
    """Peak, bandwidth and the two decode steps measured in interleaved rounds (load from elsewhere hits
    all of them alike); the best round of each counts."""
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    manifest = Manifest.load(model_dir)
    weights, weight_bytes = gemm_weights(model_dir, manifest)
    num_blocks = max((batch, *extra_batches)) * (context // block_size + 1) + 1
    t_extra = {b: float("inf") for b in extra_batches}
    backend = OnnxRuntimeBackend(model_dir, manifest, num_blocks, block_size, num_threads=threads)
    rng = np.random.default_rng(0)
    for pool in (*backend.key_caches, *backend.value_caches):  # real data: no zero-page shortcuts
        pool[...] = rng.standard_normal(pool.shape, np.float32)
    n = 512 if small else 2048
    by = {"numpy": 0.0, "onnxruntime": 0.0}
    bw, t_big, t_one = 0.0, float("inf"), float("inf")
    try:
        for _ in range(rounds):
            by["numpy"] = max(by["numpy"], sgemm_gflops(n, repeats=2))
            by["onnxruntime"] = max(by["onnxruntime"], ort_sgemm_gflops(n, repeats=2, threads=threads))
            bw = max(bw, copy_gbs((32 if small else 256) << 20, repeats=2))
            t_big = min(t_big, decode_step_seconds(backend, batch, context, steps))
            for b in extra_batches:
                t_extra[b] = min(t_extra[b], decode_step_seconds(backend, b, context, steps))
            t_one = min(t_one, decode_step_seconds(backend, 1, context, steps * 3))
    finally:
        backend.close()
    flops = 2.0 * weights * batch
    shares, kernel_gflops = _profiled_shares(model_dir, manifest, threads, batch, context, block_size, flops)
    return Roofline(threads, max(by.values()), bw, weight_bytes, batch, context, t_big * 1e3, flops / t_big / 1e9,
                    kernel_gflops, shares, t_one * 1e3, weight_bytes / t_one / 1e9, sgemm_by=by,
                    attention_gflops_batch=attention_flops(manifest, batch, context) / t_big / 1e9,
                    extra_batches={b: t * 1e3 for b, t in t_extra.items()}, matmul_flops_per_token=2.0 * weights)


def _profiled_shares(model_dir: Path, manifest: Manifest, threads: int, batch: int, context: int, block_size: int,
                     flops: float) -> tuple[dict[str, float], float | None]:
    """A second backend with ORT's profiler on: op-type shares and the projection kernels' own GFLOP/s."""
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
    gemm_us = sum(agg.get(k, 0.0) for k in MATMUL_KERNELS) / steps
    return {k: v / total for k, v in agg.items()}, (flops / (gemm_us * 1e-6) / 1e9 if gemm_us else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="an octavo export folder")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--extra-batches", default="", metavar="B,B,...", help="also measure these batch sizes")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--small", action="store_true", help="one round, small sgemm/copy sizes (a smoke run, not a peak)")
    args = p.parse_args(argv)
    r = measure(args.model, threads=args.threads, batch=args.batch, context=args.context, steps=args.steps,
                rounds=1 if args.small else 3, small=args.small,
                extra_batches=tuple(int(b) for b in args.extra_batches.split(",") if b.strip()))
    print(r.lines())
    if args.json:
        args.json.write_text(json.dumps(r.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
