"""Micro-benchmark: octavo.PagedAttention (our C++ op) beside ONNX Runtime's own
com.microsoft.GroupQueryAttention (contiguous KV, CPU) on the same shapes. Prints µs per call and
the ratio; both run in this process with the same thread count. Not a test.

--large: decode at batch 64 over pools far beyond the last-level cache, float32, float16 and int8 pools
(issue 9's model shape: 8 query / 4 kv heads, head_dim 64, block 16). Each call uses the next of
several "layers" (own pools, same shapes) so nothing stays cached between calls, as in a real
model; blocks are scattered over each pool. Prints µs per call and the KV bytes read per second.
--library OTHER.so adds a second build of the op (e.g. the previous kernel, or a wheel's portable build),
interleaved with the current one, and prints the ratio OTHER/current (without --large it takes
GroupQueryAttention's place on the three shapes).

    .venv/bin/python -m benchmarks.bench_op [--threads N] [--rounds N] [--large] [--library OTHER.so] [--cpu-time]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from op_cases import paged_attention_model, random_step  # noqa: E402

from octavo.runtime.backends.oplib import library_path  # noqa: E402
from octavo.export.manifest import kv_head_bytes  # noqa: E402
from octavo.runtime.backends.ort_kv_pools import set_cache_dtype  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16
# what a call's time is measured with: wall time, or with --cpu-time (one thread) this thread's CPU time, which
# load from other processes hardly moves (ORT runs a 1-thread session on the calling thread)
CLOCK = [time.perf_counter]


def session(model_bytes: bytes, threads: int, custom: bool, library: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if custom:
        options.register_custom_ops_library(library or str(library_path()))
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


Runner = tuple[ort.InferenceSession, ort.IOBinding]


def time_calls(runner: Runner, calls: int) -> float:
    """Median µs of `calls` runs."""
    sess, binding = runner
    samples = []
    for _ in range(calls):
        start = CLOCK[0]()
        sess.run_with_iobinding(binding)
        samples.append(CLOCK[0]() - start)
    return float(np.median(samples)) * 1e6


def compare(ours: Runner, peer: Runner | None, rounds: int, calls: int) -> tuple[float, float | None, float | None]:
    """Interleaves the two in short rounds so that load from elsewhere hits both alike; returns the
    medians over rounds of ours, the peer, and the per-round ratio peer/ours."""
    for runner in (ours, peer):
        if runner is not None:
            time_calls(runner, 3)  # warm-up
    ours_t, peer_t, ratios = [], [], []
    for _ in range(rounds):
        ours_t.append(time_calls(ours, calls))
        if peer is not None:
            peer_t.append(time_calls(peer, calls))
            ratios.append(peer_t[-1] / ours_t[-1])
    if peer is None:
        return float(np.median(ours_t)), None, None
    return float(np.median(ours_t)), float(np.median(peer_t)), float(np.median(ratios))


def paged_runner(batch: int, past: int, new: int, threads: int, library: str | None = None) -> Runner:
    rng = np.random.default_rng(0)
    step = random_step(rng, [(past, new)] * batch, num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=HEAD_DIM,
                       block_size=BLOCK)
    model = paged_attention_model(num_heads=HEADS, kv_num_heads=KV_HEADS, scale=HEAD_DIM ** -0.5,
                                  cache_outputs=False)
    sess = session(model.SerializeToString(), threads, custom=True, library=library)
    binding = sess.io_binding()
    feeds = step.feeds()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    binding.bind_output("output")
    return sess, binding


def gqa_runner(batch: int, past: int, new: int, threads: int) -> Runner:
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("query", f, [batch, new, HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("key", f, [batch, new, KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("value", f, [batch, new, KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("past_key", f, [batch, KV_HEADS, past, HEAD_DIM]),
        helper.make_tensor_value_info("past_value", f, [batch, KV_HEADS, past, HEAD_DIM]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")]
    node = helper.make_node("GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS, scale=HEAD_DIM ** -0.5)
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)], ir_version=9)
    sess = session(model.SerializeToString(), threads, custom=False)
    rng = np.random.default_rng(0)
    total = past + new
    feeds = {
        "query": rng.standard_normal((batch, new, HEADS * HEAD_DIM), dtype=np.float32),
        "key": rng.standard_normal((batch, new, KV_HEADS * HEAD_DIM), dtype=np.float32),
        "value": rng.standard_normal((batch, new, KV_HEADS * HEAD_DIM), dtype=np.float32),
        "past_key": rng.standard_normal((batch, KV_HEADS, past, HEAD_DIM), dtype=np.float32),
        "past_value": rng.standard_normal((batch, KV_HEADS, past, HEAD_DIM), dtype=np.float32),
        "seqlens_k": np.full((batch,), total - 1, dtype=np.int32),
        "total_sequence_length": np.array(total, dtype=np.int32),
    }
    binding = sess.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    for name in ("output", "present_key", "present_value"):
        binding.bind_output(name)
    return sess, binding


LARGE_HEADS, LARGE_KV_HEADS = 8, 4  # issue 9's benchmark model (hidden 512, 8 heads, 4 kv heads)
LARGE_BATCH = 64
LARGE_MIN_BYTES = 512 << 20  # pools over all layers, whatever the dtype: 16x a 32 MB L3


@dataclass(slots=True)
class LayerCycle:
    """One session; per layer a binding with its own pools. Each call runs the next layer."""
    sess: ort.InferenceSession
    bindings: list[ort.IOBinding]
    kv_bytes_per_call: int
    next: int = 0

    def call(self) -> None:
        self.sess.run_with_iobinding(self.bindings[self.next])
        self.next = (self.next + 1) % len(self.bindings)


def int8_pool(pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """An int8 pool of POOL's shape (head rows + their 2 scale bytes): random codes, every scale 1/64."""
    out = rng.integers(-127, 128, (*pool.shape[:-1], pool.shape[-1] + 2), dtype=np.int8)
    out[..., -2:] = np.array([1 / 64], np.float16).view(np.int8)
    return out


def large_cycle(context: int, dtype: str, threads: int, library: str | None) -> LayerCycle:
    """Decode B=64 at CONTEXT tokens each; enough layers that their pools total LARGE_MIN_BYTES."""
    head_bytes = kv_head_bytes(dtype, HEAD_DIM)  # int8: the codes and the row's scale
    row_bytes = 2 * LARGE_KV_HEADS * head_bytes  # key + value of one token, one layer
    per_layer = LARGE_BATCH * context * row_bytes
    layers = max(2, -(-LARGE_MIN_BYTES // per_layer))
    model = paged_attention_model(num_heads=LARGE_HEADS, kv_num_heads=LARGE_KV_HEADS, scale=HEAD_DIM ** -0.5,
                                  cache_outputs=False)
    set_cache_dtype(model, dtype)
    sess = session(model.SerializeToString(), threads, custom=True, library=library)
    bindings = []
    for layer in range(layers):
        rng = np.random.default_rng(layer)
        step = random_step(rng, [(context - 1, 1)] * LARGE_BATCH, num_heads=LARGE_HEADS,
                           kv_num_heads=LARGE_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, spare_blocks=0)
        binding = sess.io_binding()
        for name, array in step.feeds().items():
            if name in ("key_cache", "value_cache"):
                array = int8_pool(array, rng) if dtype == "int8" else array.astype(dtype)
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        binding.bind_output("output")
        bindings.append(binding)
    return LayerCycle(sess, bindings, per_layer)


def time_cycle(cycle: LayerCycle, calls: int) -> float:
    """Median µs of CALLS calls, each on the next layer."""
    samples = []
    for _ in range(calls):
        start = CLOCK[0]()
        cycle.call()
        samples.append(CLOCK[0]() - start)
    return float(np.median(samples)) * 1e6


def run_large(threads: int, rounds: int, other: str | None) -> None:
    print(f"\nlarge pools: decode B={LARGE_BATCH}, {LARGE_HEADS}q/{LARGE_KV_HEADS}kv heads, head_dim {HEAD_DIM}, "
          f"block {BLOCK}, >= {LARGE_MIN_BYTES >> 20} MiB of pools cycled per shape")
    for context in (128, 256, 512, 1024):
        for dtype in ("float32", "float16", "int8"):
            cycles = {"current": large_cycle(context, dtype, threads, None)}
            if other is not None:
                try:
                    cycles["other"] = large_cycle(context, dtype, threads, other)
                except Exception as error:  # noqa: BLE001 - an older build may lack float16 pools
                    print(f"  (other library on {dtype}: {str(error).splitlines()[0][:100]})")
            calls = max(4, len(cycles["current"].bindings))
            for cycle in cycles.values():
                time_cycle(cycle, calls)  # warm-up: every layer once
            times: dict[str, list[float]] = {name: [] for name in cycles}
            for _ in range(rounds):
                for name, cycle in cycles.items():
                    times[name].append(time_cycle(cycle, calls))
            us = float(np.median(times["current"]))
            gbps = cycles["current"].kv_bytes_per_call / us / 1e3
            line = f"ctx{context:<5d} {dtype:8s} {us:9.1f} µs  {gbps:5.2f} GB/s of KV"
            if "other" in times:
                ratio = float(np.median([o / c for o, c in zip(times["other"], times["current"])]))
                line += f"   other {float(np.median(times['other'])):9.1f} µs   ratio other/current {ratio:5.2f}x"
            print(line, flush=True)
            del cycles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT default)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per shape")
    parser.add_argument("--large", action="store_true", help="only the batch-64 decode over pools beyond the LLC")
    parser.add_argument("--library", help="another build of the op to compare with (e.g. the previous kernel, or a "
                                          "wheel's portable build); without --large it replaces GroupQueryAttention")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time calls by this thread's CPU time (needs --threads 1); steadier on a loaded machine")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time needs --threads 1 (other threads' work would not be counted)")
        CLOCK[0] = time.thread_time
    if args.large:
        run_large(args.threads, args.rounds, args.library)
        return 0
    shapes = {"decode B=32 ctx128": (32, 127, 1, 20), "prefill 4x256": (4, 0, 256, 2),
              "decode B=1 ctx2048": (1, 2047, 1, 20)}
    print(f"heads {HEADS}q/{KV_HEADS}kv, head_dim {HEAD_DIM}, block {BLOCK}, threads {args.threads or 'default'}")
    if args.library:
        print(f"current: {library_path()}\nother:   {args.library}")
    for label, (batch, past, new, calls) in shapes.items():
        ours = paged_runner(batch, past, new, args.threads)
        peer_name = "other" if args.library else "com.microsoft.GroupQueryAttention"
        try:
            peer: Runner | None = (paged_runner(batch, past, new, args.threads, args.library) if args.library
                                   else gqa_runner(batch, past, new, args.threads))
        except Exception as error:  # noqa: BLE001 - the peer is optional
            print(f"  ({peer_name} unavailable: {error})")
            peer = None
        ours_us, peer_us, ratio = compare(ours, peer, args.rounds, calls)
        line = f"{label:20s} octavo.PagedAttention {ours_us:9.1f} µs"
        if peer_us is not None:
            line += f"   {peer_name} {peer_us:9.1f} µs   ratio {'other' if args.library else 'GQA'}/octavo {ratio:5.2f}x"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
