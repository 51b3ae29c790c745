"""End-to-end stand-in for the TensorRT engine, runnable on CPU: the ONNX graph exactly as handed to
TensorRT's parser (after `prepare_onnx_for_tensorrt`), evaluated by onnx's ReferenceEvaluator, with every
PagedAttention node executed by the SAME Triton kernel the plugin embeds (TRITON_INTERPRET=1), against
HF transformers' logits. A prefill step and a decode step share the pools, so the decode logits are only
right if the first step's K/V were written into the caller's pools in place.

What this does NOT cover: TensorRT's parser, builder, plugin registry, AOT launch and aliasing, which
only a machine with TensorRT and a GPU exercises (tests/test_tensorrt.py, scripts/gpu_check.py).
Runs in a subprocess because triton must be imported after TRITON_INTERPRET is set.
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
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 1, 30, 77, 120, 9, 14, 200, 6, 33]  # 19 tokens, crosses a block
BLOCK = 16


def _plugin_op():  # noqa: ANN202
    """onnx.reference op for the parser-ready node: op_type PagedAttention in the default domain."""
    import torch
    from onnx.reference.op_run import OpRun

    from octavo.tensorrt.gpu_kernel import paged_attention

    class PagedAttention(OpRun):
        op_domain = ""

        def _run(self, query, key, value, key_cache, value_cache, cu, past, table, slots,  # noqa: ANN001, ANN202, PLR0913
                 num_heads=None, kv_num_heads=None, scale=None, sliding_window=None, softcap=None,
                 plugin_namespace=None, plugin_version=None, aot=None):
            assert (plugin_namespace, plugin_version, aot) == ("octavo", "1", 1), (plugin_namespace, plugin_version, aot)
            t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
            kc, vc = torch.from_numpy(key_cache), torch.from_numpy(value_cache)  # share memory: written in place
            out = paged_attention(t(query), t(key), t(value), kc, vc, t(cu), t(past), t(table), t(slots),
                                  num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
                                  sliding_window=sliding_window, softcap=softcap)
            return out.numpy(), key_cache, value_cache

    return PagedAttention


def emulate(export_dir: str, kv_dtype: str) -> dict:
    """Inside the interpreter subprocess: prefill + decode through the prepared graph."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    from octavo.tensorrt.onnx_rewrite import prepare_onnx_for_tensorrt
    from octavo.export.manifest import Manifest

    folder = Path(export_dir)
    manifest = Manifest.load(folder)
    prepared = prepare_onnx_for_tensorrt(folder / manifest.onnx_file, folder / f"trt.{kv_dtype}.onnx",
                                         block_size=BLOCK, kv_dtype=kv_dtype)
    session = ReferenceEvaluator(onnx.load(str(prepared)), new_ops=[_plugin_op()])
    np_dtype = {"float32": np.float32, "float16": np.float16}[kv_dtype]
    pools = {f"{kind}.{layer}": np.zeros((8, BLOCK, manifest.num_kv_heads, manifest.head_dim), np_dtype)
             for layer in range(manifest.num_layers) for kind in ("key_cache", "value_cache")}
    table = np.array([[5, 2]], np.int32)  # shuffled physical blocks
    slots = lambda ps: np.array([table[0, p // BLOCK] * BLOCK + p % BLOCK for p in ps], np.int64)  # noqa: E731
    n = len(PROMPT)
    step1 = {"input_ids": np.array(PROMPT, np.int64), "position_ids": np.arange(n, dtype=np.int64),
             "cumulative_sequence_length": np.array([0, n], np.int32), "past_seqlens": np.array([0], np.int32),
             "block_table": table, "slot_mapping": slots(range(n)), "logits_indices": np.array([n - 2, n - 1], np.int64)}
    logits1 = session.run(["logits"], {**step1, **pools})[0]
    nxt = int(logits1[-1].argmax())
    step2 = {"input_ids": np.array([nxt], np.int64), "position_ids": np.array([n], np.int64),
             "cumulative_sequence_length": np.array([0, 1], np.int32), "past_seqlens": np.array([n], np.int32),
             "block_table": table, "slot_mapping": slots([n]), "logits_indices": np.array([0], np.int64)}
    logits2 = session.run(["logits"], {**step2, **pools})[0]
    written = int(sum(np.count_nonzero(p) for p in pools.values()))
    return {"kv_dtype": kv_dtype, "next": nxt, "logits1": logits1.tolist(), "logits2": logits2.tolist(),
            "nonzero_pool_values": written}


# dtype -> atol on logits vs transformers (fp32); float16 also has the projection weights and GEMMs in
# fp16 (numpy's fp16 matmul in the evaluator, coarser than TensorRT's fp32 accumulation)
KV_DTYPES = {"float32": 1e-3, "float16": 1.5e-1}


def _worker(export_dir: str) -> None:
    for kv_dtype in KV_DTYPES:
        print(json.dumps(emulate(export_dir, kv_dtype)), flush=True)


# q/k norms, sandwich norms + GELU + two rope tables, fused weights; -m slow: layers without rope, partial rotary
# with longrope's attention factor on cos/sin (~20 s each: the interpreted kernel)
ARCHS = ["llama", "qwen3", "gemma3", "phi3", pytest.param("smollm3", marks=pytest.mark.slow),
         pytest.param("phi4mini", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, hf_model_dir):  # noqa: ANN001, ANN201
    """arch -> its HF folder. phi4mini's context is set to its original one (32), so that the export and
    transformers (whose 20-token forward is within it) both use the short factors; its attention factor 1.25."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = hf_model_dir(arch)
            if arch == "phi4mini":
                made[arch] = tmp_path_factory.mktemp("phi4mini_short") / "hf"
                shutil.copytree(hf_model_dir(arch), made[arch])
                config = json.loads((made[arch] / "config.json").read_text())
                config["max_position_embeddings"] = 32
                config["rope_parameters"]["attention_factor"] = 1.25
                (made[arch] / "config.json").write_text(json.dumps(config))
        return made[arch]

    return get


@pytest.fixture(scope="module")
def emulated(tmp_path_factory, source):  # noqa: ANN001, ANN201
    """arch -> {kv dtype -> emulation result}, each arch exported and emulated once (in a subprocess)."""
    export = pytest.importorskip("octavo.export.exporter")
    done: dict[str, dict[str, dict]] = {}

    def get(arch: str) -> dict[str, dict]:
        if arch not in done:
            folder = tmp_path_factory.mktemp(f"trt_emulation_{arch}") / "model"
            export.export_model(source(arch), folder, progress=False)
            env = dict(os.environ, TRITON_INTERPRET="1")
            env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
            code = f"import test_tensorrt_onnx_emulation as t; t._worker({str(folder)!r})"
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            assert proc.returncode == 0, proc.stderr[-4000:]
            rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            done[arch] = {row["kv_dtype"]: row for row in rows}
        return done[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_prepared_graph_with_triton_kernel_matches_transformers(emulated, source,  # noqa: ANN001
                                                                 kv_dtype: str, arch: str) -> None:
    import torch

    from models import load_hf

    result, atol = emulated(arch)[kv_dtype], KV_DTYPES[kv_dtype]
    model, _ = load_hf(source(arch))
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT + [result["next"]]])).logits[0].numpy()
    n = len(PROMPT)
    got1, got2 = np.array(result["logits1"]), np.array(result["logits2"])
    np.testing.assert_allclose(got1, ref[n - 2:n], atol=atol, rtol=0)
    np.testing.assert_allclose(got2[0], ref[n], atol=atol, rtol=0)  # needs step 1's K/V in the pool
    assert result["nonzero_pool_values"] > 0, "the pools passed in were not written"
    assert result["next"] == int(ref[n - 1].argmax())
    assert int(got2[0].argmax()) == int(ref[n].argmax())
