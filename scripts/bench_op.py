"""Micro-benchmark: octavo.PagedAttention (our C++ op) beside ONNX Runtime's own
com.microsoft.GroupQueryAttention (contiguous KV, CPU) on the same shapes. Prints µs per call and
the ratio; both run in this process with the same thread count. Not a test.

    .venv/bin/python scripts/bench_op.py [--threads N] [--iters N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from op_cases import paged_attention_model, random_step  # noqa: E402

from octavo.runtime.backends.oplib import library_path  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16


def session(model_bytes: bytes, threads: int, custom: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if custom:
        options.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def time_binding(sess: ort.InferenceSession, binding: ort.IOBinding, iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        sess.run_with_iobinding(binding)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        sess.run_with_iobinding(binding)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) * 1e6


def bench_paged(batch: int, past: int, new: int, threads: int, iters: int) -> float:
    rng = np.random.default_rng(0)
    step = random_step(rng, [(past, new)] * batch, num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=HEAD_DIM,
                       block_size=BLOCK)
    model = paged_attention_model(num_heads=HEADS, kv_num_heads=KV_HEADS, scale=HEAD_DIM ** -0.5,
                                  cache_outputs=False)
    sess = session(model.SerializeToString(), threads, custom=True)
    binding = sess.io_binding()
    feeds = step.feeds()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    binding.bind_output("output")
    return time_binding(sess, binding, iters)


def bench_gqa(batch: int, past: int, new: int, threads: int, iters: int) -> float:
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
    return time_binding(sess, binding, iters)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT default)")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    shapes = {"decode B=32 ctx128": (32, 127, 1), "prefill 4x256": (4, 0, 256)}
    print(f"heads {HEADS}q/{KV_HEADS}kv, head_dim {HEAD_DIM}, block {BLOCK}, threads {args.threads or 'default'}")
    for label, (batch, past, new) in shapes.items():
        iters = args.iters if new == 1 else max(10, args.iters // 10)
        ours = bench_paged(batch, past, new, args.threads, iters)
        try:
            peer = bench_gqa(batch, past, new, args.threads, iters)
        except Exception as error:  # noqa: BLE001 - the peer is optional
            print(f"{label:20s} octavo {ours:9.1f} µs   GroupQueryAttention unavailable: {error}")
            continue
        print(f"{label:20s} octavo {ours:9.1f} µs   ORT GroupQueryAttention {peer:9.1f} µs   "
              f"ratio (GQA / octavo) {peer / ours:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
