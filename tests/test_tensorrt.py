"""The TensorRT path: what runs without TensorRT (ONNX rewrite, profiles, launch geometry, clear errors),
and the engine build/run tests that need TensorRT + an NVIDIA GPU (skipped here: "TensorRT not installed").
"""
from __future__ import annotations

import importlib.util
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from octavo.tensorrt.onnx_rewrite import ATTRIBUTE_DEFAULTS, prepare_onnx_for_tensorrt
from octavo.tensorrt import plugin as plugin_module
from octavo.tensorrt.builder import TensorRTBuildOptions, profile_shapes
from octavo.errors import BackendUnavailableError, ModelFormatError
from octavo.export.manifest import Manifest

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
needs_tensorrt = pytest.mark.skipif(not HAVE_TENSORRT, reason="TensorRT not installed")


def _manifest(layers: int = 2) -> Manifest:
    return Manifest(architecture="llama", num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                    hidden_size=64, vocab_size=384, max_context=1024, rope_theta=10000.0)


def _toy_model(path, layers: int = 2, with_optional: bool = True) -> None:  # noqa: ANN001
    """A graph shaped like the exporter's: one octavo.PagedAttention per layer over per-layer pools."""
    step = [("cumulative_sequence_length", TensorProto.INT32, ["b1"]), ("past_seqlens", TensorProto.INT32, ["b"]),
            ("block_table", TensorProto.INT32, ["b", "w"]), ("slot_mapping", TensorProto.INT64, ["t"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", 64])]
    inputs += [helper.make_tensor_value_info(n, ty, s) for n, ty, s in step]
    nodes, x = [], "x"
    for layer in range(layers):
        for kind in ("key_cache", "value_cache"):
            inputs.append(helper.make_tensor_value_info(f"{kind}.{layer}", TensorProto.FLOAT, ["num_blocks", "block_size", 2, 16]))
        kv = f"kv{layer}"
        nodes.append(helper.make_node("Slice", [x, "s0", "s1", "ax"], [kv], name=f"slice{layer}"))
        optional = dict(sliding_window=0, softcap=0.0) if with_optional else {}
        # attributes deliberately NOT in registration order
        nodes.append(helper.make_node(
            "PagedAttention", [x, kv, kv, f"key_cache.{layer}", f"value_cache.{layer}", "cumulative_sequence_length",
                               "past_seqlens", "block_table", "slot_mapping"],
            [f"attn{layer}", f"kc{layer}", f"vc{layer}"], name=f"attn{layer}", domain="octavo",
            scale=0.25, kv_num_heads=2, num_heads=4, **optional))
        x = f"attn{layer}"
    inits = [onnx.numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("s0", [0]), ("s1", [32]), ("ax", [1]))]
    graph = helper.make_graph(nodes, "toy", inputs, [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["t", 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("octavo", 1)])
    onnx.save(model, str(path))


def _attrs(node: onnx.NodeProto) -> list[tuple[str, object]]:
    return [(a.name, helper.get_attribute_value(a)) for a in node.attribute]


# ---- ONNX rewrite for TensorRT's parser --------------------------------------------------------------
def test_prepare_onnx_maps_nodes_to_plugin(tmp_path) -> None:  # noqa: ANN001
    _toy_model(tmp_path / "model.onnx", with_optional=False)
    out = prepare_onnx_for_tensorrt(tmp_path / "model.onnx", tmp_path / "trt.onnx", block_size=32)
    model = onnx.load(str(out))
    attention = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == 2
    for node in attention:
        assert node.domain == ""
        attrs = _attrs(node)
        # plugin attributes in registration order, omitted optional ones filled, then what the parser reads
        assert [name for name, _ in attrs] == [*ATTRIBUTE_DEFAULTS, "plugin_namespace", "plugin_version", "aot"]
        values = dict(attrs)
        assert values["aot"] == 1  # STRICT_AOT request in onnx-tensorrt's plugin importer
        assert values["num_heads"] == 4 and values["kv_num_heads"] == 2 and values["scale"] == pytest.approx(0.25)
        assert values["sliding_window"] == 0 and values["softcap"] == 0.0
        assert values["plugin_namespace"] == b"octavo" and values["plugin_version"] == b"1"
    pools = [i for i in model.graph.input if i.name.startswith(("key_cache.", "value_cache."))]
    assert len(pools) == 4
    for pool in pools:
        dims = pool.type.tensor_type.shape.dim
        assert dims[0].dim_param == "num_blocks" and dims[1].dim_value == 32
        assert pool.type.tensor_type.elem_type == TensorProto.FLOAT
    assert not any(n.op_type == "Cast" for n in model.graph.node)
    # the aliased pool outputs are graph outputs named after their inputs, typed and shaped like them
    outputs = {o.name: o for o in model.graph.output}
    for node in attention:
        assert list(node.output[1:]) == [f"{node.input[3]}.out", f"{node.input[4]}.out"]
        for pool_name in node.input[3:5]:
            out = outputs[f"{pool_name}.out"]
            pool = next(i for i in pools if i.name == pool_name)
            assert out.type == pool.type
    assert list(outputs)[0] == "attn1" and len(outputs) == 1 + 4


def test_prepare_onnx_attribute_order_matches_plugin_registration() -> None:
    """tensorrt.plugin passes attributes positionally: the rewrite's order must be the plugin's."""
    plugin = plugin_module
    assert list(plugin.ATTRIBUTES) == list(ATTRIBUTE_DEFAULTS)
    assert (plugin.PLUGIN_NAMESPACE, plugin.PLUGIN_NAME, plugin.PLUGIN_VERSION) == ("octavo", "PagedAttention", "1")


def test_prepare_onnx_half_pools_cast_around_attention(tmp_path) -> None:  # noqa: ANN001
    _toy_model(tmp_path / "model.onnx")
    model = onnx.load(str(prepare_onnx_for_tensorrt(tmp_path / "model.onnx", tmp_path / "o" / "trt.onnx", kv_dtype="float16")))
    pools = [i for i in model.graph.input if i.name.startswith(("key_cache.", "value_cache."))]
    assert all(p.type.tensor_type.elem_type == TensorProto.FLOAT16 for p in pools)
    pool_outputs = [o for o in model.graph.output if o.name.endswith(".out")]
    assert len(pool_outputs) == 4 and all(o.type.tensor_type.elem_type == TensorProto.FLOAT16 for o in pool_outputs)
    names = [n.name for n in model.graph.node]
    for layer in range(2):
        node = next(n for n in model.graph.node if n.name == f"attn{layer}")
        assert all(i.endswith(".kv_cast") for i in node.input[:3])
        # every cast feeding the node comes before it; the output cast right after it, restoring the name
        assert names.index(f"attn{layer}.cast_in0") < names.index(f"attn{layer}") < names.index(f"attn{layer}.cast_out")
        cast_out = next(n for n in model.graph.node if n.name == f"attn{layer}.cast_out")
        assert list(cast_out.output) == [f"attn{layer}"] and dict(_attrs(cast_out))["to"] == TensorProto.FLOAT


def _register_paged_attention_schema() -> None:
    """An onnx schema for the parser-ready node (one type T for q/k/v/pools/output), so onnx's own type
    inference can check the rewritten graph the way a strongly typed TensorRT network does."""
    if onnx.defs.has("PagedAttention", ""):
        return
    from onnx.defs import OpSchema

    float_types = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    p = OpSchema.FormalParameter
    inputs = [p(n, "T") for n in ("query", "key", "value", "key_cache", "value_cache")]
    inputs += [p("cumulative_sequence_length", "I"), p("past_seqlens", "I"), p("block_table", "I"), p("slot_mapping", "L")]
    attrs = [OpSchema.Attribute(n, t, "") for n, t in (
        ("num_heads", OpSchema.AttrType.INT), ("kv_num_heads", OpSchema.AttrType.INT), ("scale", OpSchema.AttrType.FLOAT),
        ("sliding_window", OpSchema.AttrType.INT), ("softcap", OpSchema.AttrType.FLOAT),
        ("plugin_namespace", OpSchema.AttrType.STRING), ("plugin_version", OpSchema.AttrType.STRING),
        ("aot", OpSchema.AttrType.INT))]
    schema = OpSchema("PagedAttention", "", 1, inputs=inputs, outputs=[p("output", "T"), p("key_cache_out", "T"),
                                                                         p("value_cache_out", "T")],
                      type_constraints=[("T", float_types, ""), ("I", ["tensor(int32)"], ""), ("L", ["tensor(int64)"], "")],
                      attributes=attrs)
    onnx.defs.register_schema(schema)


@pytest.mark.parametrize(("dtype", "elem"), [("float16", TensorProto.FLOAT16), ("bfloat16", TensorProto.BFLOAT16)])
def test_prepare_onnx_half_graph_is_strongly_typed(tmp_path, hf_model_dir, dtype: str, elem: int) -> None:  # noqa: ANN001
    """TensorRT 11 has no FP16 builder flag: the types must be in the graph. Projection and embedding
    weights become DTYPE initializers, every Gemm sees one input type, and onnx's type inference (strict,
    check_type) accepts the whole rewritten graph, with logits still float32."""
    export = pytest.importorskip("octavo.export.exporter")
    folder = tmp_path / "exported"
    manifest = export.export_model(hf_model_dir("llama"), folder, progress=False)
    out = prepare_onnx_for_tensorrt(folder / manifest.onnx_file, folder / f"trt.{dtype}.onnx", kv_dtype=dtype)
    model = onnx.load(str(out), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 4 * manifest.num_layers + 1  # qkv, o, gate_up, down per layer + lm_head
    assert all(inits[n.input[1]].data_type == elem for n in gemms)
    assert inits["model.embed_tokens.weight"].data_type == elem
    norms = [t for name, t in inits.items() if name.endswith("norm.weight")]
    assert norms and all(t.data_type == TensorProto.FLOAT for t in norms)  # norms stay float32
    _register_paged_attention_schema()
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    assert types["logits"] == TensorProto.FLOAT
    for node in gemms:
        assert types[node.output[0]] == elem, node.name
    # the converted weights are the fp32 ones rounded (independent check against torch's rounding)
    import torch

    full = onnx.load(str(out))
    original = onnx.load(str(folder / manifest.onnx_file))
    src = onnx.numpy_helper.to_array(next(t for t in original.graph.initializer if t.name == "model.embed_tokens.weight"))
    got = next(t for t in full.graph.initializer if t.name == "model.embed_tokens.weight")
    want = torch.from_numpy(src.copy()).to(getattr(torch, dtype)).view(torch.int16).numpy().view(np.uint16)
    raw = np.frombuffer(got.raw_data, np.uint16).reshape(src.shape)
    np.testing.assert_array_equal(raw, want)


def test_half_weights_refuse_float16_overflow() -> None:
    from octavo.tensorrt.half_weights import half_bytes

    with pytest.raises(ModelFormatError, match=r"float16 cannot hold; build with --dtype bf16"):
        half_bytes(np.array([1.0, 70000.0], np.float32), "float16", "w")
    assert len(half_bytes(np.array([1.0, 70000.0], np.float32), "bfloat16", "w")) == 4


def test_prepare_onnx_refuses_quantized_export(tmp_path) -> None:  # noqa: ANN001
    _toy_model(tmp_path / "model.onnx")
    model = onnx.load(str(tmp_path / "model.onnx"))
    model.graph.node.append(helper.make_node("MatMulNBits", ["x", "s0"], ["q"], name="mm", domain="com.microsoft"))
    onnx.save(model, str(tmp_path / "q.onnx"))
    with pytest.raises(ModelFormatError, match=r"quantized exports \(--weights int8\|int4, --quant-kernel matmulnbits\) run on ONNX Runtime only "
                                               r"\(MatMulNBits has no TensorRT plugin\)"):
        prepare_onnx_for_tensorrt(tmp_path / "q.onnx", tmp_path / "o.onnx")


def test_prepare_onnx_rejects_non_octavo_model(tmp_path) -> None:  # noqa: ANN001
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(tmp_path / "m.onnx"))
    with pytest.raises(ModelFormatError, match="no PagedAttention"):
        prepare_onnx_for_tensorrt(tmp_path / "m.onnx", tmp_path / "o.onnx")
    with pytest.raises(ValueError, match="kv_dtype"):
        prepare_onnx_for_tensorrt(tmp_path / "m.onnx", tmp_path / "o.onnx", kv_dtype="int8")


def test_prepare_onnx_on_real_export_keeps_weights_reachable(tmp_path, hf_model_dir) -> None:  # noqa: ANN001
    export = pytest.importorskip("octavo.export.exporter")
    folder = tmp_path / "exported"
    manifest = export.export_model(hf_model_dir("llama"), folder, progress=False)
    out = prepare_onnx_for_tensorrt(folder / manifest.onnx_file, tmp_path / "elsewhere" / "trt.onnx", block_size=16)
    model = onnx.load(str(out))  # loads the external weights through the symlinked data file
    attention = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == manifest.num_layers
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert weights["model.embed_tokens.weight"].shape == (manifest.vocab_size, manifest.hidden_size)
    names = {i.name for i in model.graph.input}
    shapes = profile_shapes(manifest, TensorRTBuildOptions(max_num_blocks=1000), max_blocks_per_seq=64, max_num_logits=64)
    assert names == set(shapes), "every graph input needs an optimization-profile range"


# ---- optimization profile, launch geometry, memory sizing ------------------------------------------
def test_profile_shapes_are_ordered_and_respect_limits() -> None:
    options = TensorRTBuildOptions(max_num_tokens=512, max_num_seqs=8, block_size=16, max_num_blocks=1000)
    shapes = profile_shapes(_manifest(3), options, max_blocks_per_seq=64, max_num_logits=8)
    assert len(shapes) == 7 + 2 * 3
    for name, (lo, opt, hi) in shapes.items():
        assert len(lo) == len(opt) == len(hi), name
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), name
    assert shapes["input_ids"][2] == (512,)
    assert shapes["cumulative_sequence_length"][2] == (9,)
    assert shapes["block_table"][2] == (8, 64)
    assert shapes["key_cache.2"][2] == (1000, 16, 2, 16)
    assert shapes["key_cache.0"][0][1:] == shapes["key_cache.0"][2][1:], "pool tail dims are static"


@pytest.mark.parametrize("seed", range(20))
def test_launch_grid_covers_every_query_tile(seed: int) -> None:
    """The AOT grid is a function of shapes only; it must never be smaller than the tiles the kernel needs."""
    plugin = plugin_module
    rng = np.random.default_rng(seed)
    block_m = int(rng.choice([1, 2, 4, 8, 16]))
    lengths = rng.integers(0 if seed % 3 == 0 else 1, 40, size=int(rng.integers(1, 12)))
    grid_x, grid_y = plugin.launch_grid(int(lengths.sum()), len(lengths), kv_num_heads=2, block_m=block_m)
    assert grid_y == 2
    assert grid_x >= sum(math.ceil(n / block_m) for n in lengths)


def test_cpu_side_imports_neither_triton_nor_tensorrt() -> None:
    """The backend module, the builder, the CLI command and the plugin's launch geometry load without
    triton or tensorrt (import-guarded), so no test here fixes triton's interpreter mode by accident."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import octavo.tensorrt.backend, octavo.tensorrt.builder, octavo.commands.build\n"
        "from octavo.tensorrt.plugin import launch_grid\n"
        "launch_grid(10, 2, kv_num_heads=2, block_m=4)\n"
        "print(sorted(m for m in ('triton', 'tensorrt', 'cuda') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_pool_blocks_for_memory() -> None:
    from octavo.tensorrt.backend import pool_blocks_for_memory

    assert pool_blocks_for_memory(10_000, 0.5, 100, max_blocks=1000) == 50
    assert pool_blocks_for_memory(10_000, 1.0, 100, max_blocks=30) == 30
    with pytest.raises(Exception, match="fraction"):
        pool_blocks_for_memory(10_000, 1.5, 100, max_blocks=30)


# ---- clear errors on a machine without TensorRT ----------------------------------------------------
@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed: the missing-TensorRT error cannot occur")
def test_backend_module_imports_and_constructing_it_says_why(tmp_path) -> None:  # noqa: ANN001
    from octavo.tensorrt.backend import TensorRTBackend

    with pytest.raises(BackendUnavailableError, match=r"TensorRT is not installed \(pip install tensorrt"):
        TensorRTBackend(tmp_path, _manifest())


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed: the missing-TensorRT error cannot occur")
def test_build_command_without_tensorrt_is_a_clear_error(tmp_path, capsys) -> None:  # noqa: ANN001
    from octavo.cli import main

    _manifest().save(tmp_path)
    rc = main(["build", str(tmp_path), "--target", "tensorrt", "--dtype", "fp16", "--max-num-tokens", "256"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "octavo build: error: TensorRT is not installed (pip install tensorrt on a machine with an NVIDIA GPU)" in err
    assert "Traceback" not in err


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed: the missing-TensorRT error cannot occur")
def test_engine_with_tensorrt_backend_says_why(tmp_path, hf_model_dir) -> None:  # noqa: ANN001
    """EngineArgs(backend="tensorrt") through the real engine: a clear BackendUnavailableError."""
    export = pytest.importorskip("octavo.export.exporter")
    engine_mod = pytest.importorskip("octavo.runtime.engine")
    from octavo.runtime.engine_args import EngineArgs

    folder = tmp_path / "m"
    export.export_model(hf_model_dir("llama"), folder, progress=False)
    with pytest.raises(BackendUnavailableError, match="TensorRT is not installed"):
        engine_mod.LLMEngine(EngineArgs(model=str(folder), backend="tensorrt"))


def test_build_command_rejects_bad_block_size(tmp_path, capsys) -> None:  # noqa: ANN001
    from octavo.cli import main

    assert main(["build", str(tmp_path), "--block-size", "24"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


# ---- needs TensorRT and an NVIDIA GPU -------------------------------------------------------------
@needs_tensorrt
def test_plugin_registers_in_tensorrt_registry() -> None:
    import tensorrt as trt

    plugin = plugin_module
    plugin.register(arch=90)
    plugin.register(arch=90)  # idempotent
    assert trt.get_plugin_registry().get_creator("PagedAttention", "1", "octavo") is not None


@needs_tensorrt
@pytest.mark.gpu
def test_tiny_engine_matches_transformers(tmp_path, hf_model_dir) -> None:  # noqa: ANN001
    """Build an fp32 engine for a tiny random llama, run a prefill step and a decode step through the paged
    pool, and compare the logits with HF transformers (the second step only matches if the first step's
    K/V landed in the pool in place)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no NVIDIA GPU visible to torch")
    from models import load_hf
    from octavo.tensorrt.builder import build_engine
    from octavo.export.exporter import export_model
    from octavo.runtime.backends.base import StepInputs
    from octavo.tensorrt.backend import TensorRTBackend

    hf_dir = hf_model_dir("llama")
    folder = tmp_path / "m"
    manifest = export_model(hf_dir, folder, progress=False)
    build_engine(folder, TensorRTBuildOptions(dtype="float32", max_num_tokens=64, max_num_seqs=4, max_num_blocks=64))
    backend = TensorRTBackend(folder, manifest, num_blocks=16)
    model, _ = load_hf(hf_dir)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 1, 30, 77, 120, 9, 14, 200, 6]  # 18 tokens: crosses a block
    table = np.array([[3, 9]], np.int32)
    slots = lambda positions: np.array([table[0, p // 16] * 16 + p % 16 for p in positions], np.int64)  # noqa: E731
    n = len(prompt)
    step1 = StepInputs(np.array(prompt, np.int64), np.arange(n, dtype=np.int64), np.array([0, n], np.int32),
                       np.array([0], np.int32), table, slots(range(n)), np.array([n - 1], np.int64))
    got1 = backend.run(step1)
    nxt = int(got1[0].argmax())
    step2 = StepInputs(np.array([nxt], np.int64), np.array([n], np.int64), np.array([0, 1], np.int32),
                       np.array([n], np.int32), table, slots([n]), np.array([0], np.int64))
    got2 = backend.run(step2)
    with torch.no_grad():
        ref = model(torch.tensor([prompt + [nxt]])).logits[0].numpy()
    np.testing.assert_allclose(got1[0], ref[n - 1], atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(got2[0], ref[n], atol=2e-3, rtol=1e-3)
    backend.close()


# ---- sizing and limits checked without TensorRT (issue 46) ----------------------------------------
def _build_info(**overrides):  # noqa: ANN202
    from octavo.tensorrt.engine_info import BuildInfo

    fields = dict(engine_file="model.float16.engine", dtype="float16", block_size=16, max_num_tokens=512,
                  max_num_seqs=8, max_blocks_per_seq=64, max_num_logits=8, max_num_blocks=1000,
                  compute_capability=90, tensorrt_version="11.4.0.106", build_seconds=1.0)
    return BuildInfo(**{**fields, **overrides})


def test_serving_limits_beyond_the_engine_are_refused_at_start_up(tmp_path) -> None:  # noqa: ANN001
    from octavo.errors import InvalidRequestError
    from octavo.tensorrt.engine_info import check_serving_limits

    info = _build_info()
    check_serving_limits(info, tmp_path, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024)  # fits
    with pytest.raises(InvalidRequestError) as caught:
        check_serving_limits(info, tmp_path, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048)
    message = str(caught.value)
    assert "--max-num-seqs 16 > the engine's 8 (rebuild with --max-num-seqs 16)" in message
    assert "--max-num-batched-tokens 2048 > the engine's 512 (rebuild with --max-num-tokens 2048)" in message
    assert "--max-model-len 2048 > the engine's 1024 tokens (64 blocks of 16; rebuild with --max-blocks-per-seq 128)" in message


def test_engine_args_are_compared_with_tensorrt_json_before_tensorrt_loads(tmp_path) -> None:  # noqa: ANN001
    """Through the engine's own backend factory: an engine folder whose tensorrt.json is smaller than the
    options is refused at start-up (before TensorRT or cuda-python is needed)."""
    from octavo.errors import InvalidRequestError
    from octavo.runtime.engine_args import EngineArgs
    from octavo.runtime.model_setup import make_backend

    manifest = _manifest()
    manifest.save(tmp_path)
    _build_info().save(tmp_path)
    args = EngineArgs(model=str(tmp_path), backend="tensorrt", max_num_seqs=64)
    with pytest.raises(InvalidRequestError, match="--max-num-seqs 64 > the engine's 8"):
        make_backend(args, tmp_path, manifest, max_model_len=1024)


def test_copy_check_needs_a_pool_big_enough_to_tell() -> None:
    from octavo.tensorrt.engine_info import COPY_CHECK_MIN_BYTES, kv_copy_suspected

    big = 4 * COPY_CHECK_MIN_BYTES
    assert kv_copy_suspected(300 << 20, big) is False  # activations well below a real pool
    assert kv_copy_suspected(big + (1 << 20), big) is True  # a pool's worth of engine memory: copies
    assert kv_copy_suspected(10 << 30, 1 << 20) is None  # tiny pools: activations can exceed them


def test_default_pool_rows_follow_the_gpu_memory_and_options_validate() -> None:
    from octavo.tensorrt.builder import EngineBuildError, default_pool_blocks

    manifest = _manifest(layers=2)  # one block: 2 layers x K+V x 16 x 2 x 16 x 2 bytes = 4096 bytes in fp16
    options = TensorRTBuildOptions(dtype="float16", gpu_memory_utilization=0.5)
    assert default_pool_blocks(8 << 30, manifest, options) == (4 << 30) // 4096
    # 80 GB would give 10.5 M blocks; each pool stays under 2^31 elements (16 x 2 x 16 = 512 per block)
    assert default_pool_blocks(80 << 30, manifest, options) == ((1 << 31) - 1) // 512
    with pytest.raises(EngineBuildError, match="no KV block"):
        default_pool_blocks(1000, manifest, options)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        TensorRTBuildOptions(gpu_memory_utilization=1.5).validate()
    with pytest.raises(ValueError, match="max_num_blocks must be resolved"):
        profile_shapes(manifest, TensorRTBuildOptions(), max_blocks_per_seq=8, max_num_logits=8)
