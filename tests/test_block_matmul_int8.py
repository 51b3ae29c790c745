"""octavo.BlockMatMul's int8 path (nodes with prompt_int8 = 1; plugins/onnxruntime/block_matmul_int8.cc) against a
numpy reference of the same rounding of x, and against x @ W^T.

The reference (independent of the kernel): x rounded to int8 per row and 32 values (q = rint(clip(x * (127 /
max|x|), -127, 127)) in float32, s = max|x| / 127), the integer sums of q times the layout's codes (exact, in int64),
then y = sum over blocks of scale * sum over the block's groups of s * isum + offset * sum(x) + bias in float64. The
op forms the same integers and does the float32 scaling: within (nb * groups + 8) u of the magnitudes it adds.
Against the float32 product the difference is x's rounding: |dx| <= max|x| / 254 per group (times |code * scale|).
Which steps take it: 4-bit codes (Q4_0, Q4_1, Q4_K) in blocks of a multiple of 32, past 8 rows, not decode-only;
8-bit codes, blocks of 16 (Q6_K) and the 16-bit path's steps keep their paths (the same bits as without it).
"""
from __future__ import annotations

import platform

import numpy as np
import pytest
from test_block_matmul import MAX_INT_ROWS, _blocks, _float_bound, _parts, _session, _want

from octavo.export.block_layout import panel_weights
from octavo.runtime.backends.op_variants import cpu_flags

U = 2.0 ** -24
AVX2 = platform.machine() == "x86_64" and {"avx2", "fma"} <= (cpu_flags() or frozenset())
pytestmark = pytest.mark.skipif(not AVX2, reason="the int8 path is built for AVX2 (other builds: float32)")


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [rows, K], s float32 [rows, K / 32]) as the kernel rounds x."""
    rows, k = x.shape
    g = x.reshape(rows, k // 32, 32).astype(np.float32)
    amax = np.abs(g).max(axis=2)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(g * inverse[..., None], -127, 127)).astype(np.int8)
    return q.reshape(rows, k), (amax / np.float32(127)).astype(np.float32)


def reference(x: np.ndarray, blocks, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """(y float64 [rows, N], the magnitude its float32 scaling rounds)."""
    n, nb, bs = blocks.codes.shape
    q, s = quantize_x(x)
    rows, k = x.shape
    codes = blocks.codes.astype(np.int64).reshape(n, k // 32, 32)
    isum = np.einsum("rgk,ngk->rng", q.reshape(rows, k // 32, 32).astype(np.int64), codes)  # exact
    scaled = (isum * s[:, None, :].astype(np.float64)).reshape(rows, n, nb, bs // 32).sum(axis=3)
    scales = blocks.scales.astype(np.float64)
    mins = 0.0 if blocks.mins is None else blocks.mins.astype(np.float64)
    offsets = mins - blocks.zero.astype(np.float64) * scales  # [n, nb]
    sums = x.astype(np.float64).reshape(rows, nb, bs).sum(axis=2)  # [rows, nb]
    y = (scaled * scales[None]).sum(axis=2) + sums @ offsets.T + (0 if bias is None else bias.astype(np.float64))
    magnitude = (np.abs(scaled) * np.abs(scales[None])).sum(axis=2) + np.abs(sums) @ np.abs(offsets).T \
        + np.abs(np.abs(x.astype(np.float64)) @ _parts(blocks)[1].T) + (0 if bias is None else np.abs(bias))
    return y, magnitude


def _check_int8(session, x: np.ndarray, blocks, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:  # noqa: ANN001
    got = session.run(None, {"x": x})[0].astype(np.float64)
    want, magnitude = reference(x, blocks, bias)
    nb = blocks.k // blocks.block_size
    bound = (nb * (blocks.block_size // 32) + 3 * 32 + 16) * U * magnitude + 1e-30
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    # and it is x @ W^T up to x's rounding (per group: max|x| / 254 times |code * scale|)
    cs = _parts(blocks)[0]
    rows, k = x.shape
    step = np.repeat(np.abs(x).reshape(rows, k // 32, 32).max(axis=2), 32, axis=1) / 254
    rounding = step.astype(np.float64) @ cs.T * (1 + 1e-6) + bound
    assert (np.abs(got - _want(x, w, bias)) <= rounding).all()
    return got


@pytest.mark.parametrize("type_name,n,k", [("Q4_0", 37, 544), ("Q4_1", 16, 96), ("Q4_K", 31, 512), ("Q4_K", 40, 2048)])
@pytest.mark.parametrize("rows", [9, 13, 64, 67, 301])
def test_int8_path_matches_the_reference(type_name: str, n: int, k: int, rows: int) -> None:
    blocks, w = _blocks(type_name, n, k, seed=rows)
    rng = np.random.default_rng(rows + n)
    bias = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 30, (rows, 1))).astype(np.float32)
    x[0, :64] = 0  # an all-zero group
    got = _check_int8(_session(panel_weights(blocks), bias, decode=False, prompt_int8=1), x, blocks, w, bias)
    # a row's bits do not depend on the others in its step nor on how tasks split it
    alone = _session(panel_weights(blocks), bias, decode=False, prompt_int8=1)
    for lo, hi in ((0, 9), (rows - 9, rows)):
        np.testing.assert_array_equal(alone.run(None, {"x": x[lo:hi]})[0], got[lo:hi].astype(np.float32))


@pytest.mark.parametrize("type_name,k", [("Q8_0", 96), ("Q6_K", 256), ("Q5_1", 64)])
def test_other_layouts_keep_the_float32_path(type_name: str, k: int) -> None:
    """8-bit codes and blocks of 16 are not the int8 path's: prompt_int8 = 1 changes no bit of them."""
    blocks, w = _blocks(type_name, 19, k, seed=3)
    x = np.random.default_rng(4).standard_normal((20, k)).astype(np.float32)
    with_attr = _session(panel_weights(blocks), decode=False, prompt_int8=1).run(None, {"x": x})[0]
    without = _session(panel_weights(blocks), decode=False).run(None, {"x": x})[0]
    np.testing.assert_array_equal(with_attr, without)


@pytest.mark.parametrize("rows,decode", [(1, False), (5, False), (8, False), (12, True), (48, True)])
def test_sixteen_bit_steps_are_unchanged(rows: int, decode: bool) -> None:
    """Steps of <= 8 rows and decode-only steps stay on the 16-bit path (decode and speculative verification must
    give the same bits with or without the attribute)."""
    blocks, w = _blocks("Q4_K", 24, 512, seed=5)
    x = np.random.default_rng(6).standard_normal((rows, 512)).astype(np.float32)
    a = _session(panel_weights(blocks), decode=decode, prompt_int8=1).run(None, {"x": x})[0]
    b = _session(panel_weights(blocks), decode=decode).run(None, {"x": x})[0]
    np.testing.assert_array_equal(a, b)
    assert rows <= MAX_INT_ROWS or decode


def test_non_finite_x_takes_the_float32_path() -> None:
    """inf / nan in a prompt's x: the step refuses int8 and propagates them as float32 does."""
    blocks, w = _blocks("Q4_0", 16, 64)
    x = np.random.default_rng(9).standard_normal((20, 64)).astype(np.float32)
    x[17, 3] = np.inf
    got = _session(panel_weights(blocks), decode=False, prompt_int8=1).run(None, {"x": x})[0]
    plain = _session(panel_weights(blocks), decode=False).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, plain)
    finite = np.ones(20, bool)
    finite[17] = False
    assert (np.abs(got[finite] - _want(x[finite], w, None)) <= _float_bound(x[finite], w, None)).all()


def test_bad_attribute_is_refused() -> None:
    blocks, _ = _blocks("Q4_0", 16, 64)
    with pytest.raises(Exception, match="prompt_int8 must be 0 or 1"):
        _session(panel_weights(blocks), prompt_int8=2)


def test_engine_prompt_activations_int8(hf_model_dir, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """EngineArgs.prompt_activations = "int8" on a Q4_0 GGUF: the loaded graph's 4-bit BlockMatMul nodes carry
    prompt_int8 = 1, a prompt's logits move by the rounding of x only (close to float32's, not equal), decode-only
    steps run the 16-bit path as before, and the knob is refused where it cannot apply."""
    import argparse
    import dataclasses

    from octavo import LLM, SamplingParams
    from octavo.commands.serve import add_engine_arguments, engine_args
    from octavo.errors import InvalidRequestError
    from octavo.export.gguf_writer import write_gguf
    from octavo.runtime.engine_args import EngineArgs

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q4_0.gguf", tensor_type="Q4_0")
    prompt = list(np.random.default_rng(1).integers(5, 300, 40))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    logprobs, tokens = {}, {}
    for mode in ("float32", "int8"):
        llm = LLM(str(path), num_threads=2, prompt_activations=mode)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        logprobs[mode] = np.array([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])
        gen = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        tokens[mode] = llm.generate([{"prompt_token_ids": prompt}], gen, use_tqdm=False)[0].outputs[0].token_ids
        import onnx

        graph = onnx.load(str(llm.engine.model_dir / "model.onnx"), load_external_data=False).graph
        attrs = [{a.name: a.i for a in n.attribute} for n in graph.node if n.op_type == "BlockMatMul"]
        assert any(a["bits"] == 4 and a["block_size"] % 32 == 0 for a in attrs)  # nodes the int8 path takes
        llm.close()
    # the int8 path ran: not float32's bits (how close it stays is measured on a trained model below; these random
    # models with initializer_range 0.4 amplify any rounding, up to ~1.4 here)
    assert np.abs(logprobs["int8"] - logprobs["float32"]).max() > 1e-3
    assert len(tokens["int8"]) == 12
    with pytest.raises(InvalidRequestError, match="prompt_activations must be one of"):
        EngineArgs(model=str(path), prompt_activations="fp8").validate()
    with pytest.raises(InvalidRequestError, match="onnxruntime backend"):
        dataclasses.replace(EngineArgs(model=str(path)), backend="tensorrt", prompt_activations="int8").validate()
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("model")
    add_engine_arguments(parser)
    assert engine_args(parser.parse_args(["m", "--prompt-activations", "int8"])).prompt_activations == "int8"


def test_set_prompt_int8_marks_only_4bit_blocks_of_32() -> None:
    from onnx import helper

    from octavo.runtime.backends.ort_fusions import set_prompt_int8

    nodes = [helper.make_node("BlockMatMul", ["x"], [f"y{i}"], domain="octavo", K=64, N=16, bits=bits, block_size=bs)
             for i, (bits, bs) in enumerate([(4, 32), (8, 32), (4, 16), (4, 64)])]
    nodes.append(helper.make_node("MatMul", ["x", "w"], ["z"]))
    moe = {"top_k": 2, "expert_inter": 64, "gate_up_block_size": 32, "down_block_size": 32}
    nodes.append(helper.make_node("MoE", ["x"], ["m0"], domain="octavo", gate_up_bits=4, down_bits=8, **moe))
    nodes.append(helper.make_node("MoE", ["x"], ["m1"], domain="octavo", gate_up_bits=8, down_bits=8, **moe))
    nodes.append(helper.make_node("MoE", ["x"], ["m2"], domain="octavo", top_k=2))  # float experts
    graph = helper.make_graph(nodes, "g", [], [])
    model = helper.make_model(graph)
    assert set_prompt_int8(model) == 3
    marked = [any(a.name == "prompt_int8" and a.i == 1 for a in n.attribute) for n in model.graph.node]
    assert marked == [True, False, False, True, False, True, False, False]
    assert set_prompt_int8(model) == 3  # idempotent: one attribute per node
    assert sum(a.name == "prompt_int8" for a in model.graph.node[0].attribute) == 1


def test_smollm2_int8_prompts_against_float32() -> None:
    """On a trained model (the embedded SmolLM2 Q4_1 GGUF: its 4-bit layers take the int8 path), ~600 tokens of
    English and code scored in prompt steps of 128: int8 activations pick float32's top-1 token at >= 95 % of the
    positions and move the actual next token's logprob by < 0.15 on average (measured: 97.2 %, 0.085, at most 4.0:
    rounding x per 32 values costs about what llama.cpp's Q8 activations cost; the bound guards against a regression,
    docs/quantization.md has the numbers)."""
    from benchmarks.kv_accuracy import forced_runs

    rows = forced_runs("smollm2-135m-instruct", {m: {"prompt_activations": m} for m in ("float32", "int8")})
    change = np.abs(np.array([lp for _, lp in rows["int8"]]) - np.array([lp for _, lp in rows["float32"]]))
    agree = np.mean([a == b for (a, _), (b, _) in zip(rows["float32"], rows["int8"])])
    assert agree >= 0.95 and 0 < change.mean() < 0.15, (agree, change.mean(), change.max())


@pytest.mark.parametrize(("gu_type", "down_type", "exact_x"), [("Q4_0", "Q4_1", False), ("Q4_K", "Q6_K", True)])
def test_moe_experts_take_the_int8_path(gu_type: str, down_type: str, exact_x: bool) -> None:
    """octavo.MoE with prompt_int8 = 1: a prompt chunk's 4-bit experts take the int8 path; 8-bit experts (Q6_K's
    down), decode-only steps and steps of <= 8 tokens keep their paths bit for bit. EXACT_X: every 32-group of x is
    k / 127 of its largest value (k integer), so rounding it to int8 loses nothing and the int8 gate/up (Q4_K) then
    down (Q6_K, float32) must give the float reference to float32 rounding; otherwise both stages round (Q4_0, Q4_1)
    and the outputs move by ~2 % of their RMS, where a wrong code, scale or row would move them by ~100 %."""
    from moe_reference import moe
    from test_moe_op import _block_session, _quantized_experts, _run

    from octavo.export.moe_blocks import stack_experts

    experts, hidden, top_k = 6, 256, 2
    inter = 256 if down_type.endswith("_K") else 96
    gate, gate_f = _quantized_experts(gu_type, experts, inter, hidden, 1)
    up, up_f = _quantized_experts(gu_type, experts, inter, hidden, 2)
    down, down_f = _quantized_experts(down_type, experts, hidden, inter, 3)
    gate_up = stack_experts([[gate[e], up[e]] for e in range(experts)])
    stacked_down = stack_experts([[down[e]] for e in range(experts)])
    rng = np.random.default_rng(7)
    for tokens, decode in ((40, False), (40, True), (6, False)):
        if exact_x:
            x = rng.integers(-127, 128, (tokens, hidden)).astype(np.float32)
            x[:, ::32] = 127  # each group's max: its scale is exactly 1
            x *= np.float32(2.0 ** -7)
        else:
            x = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
        logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
        plain = _run(_block_session(gate_up, stacked_down, inter, top_k, True, decode), x, logits)
        int8 = _run(_block_session(gate_up, stacked_down, inter, top_k, True, decode, prompt_int8=1), x, logits)
        if decode or tokens <= MAX_INT_ROWS:
            np.testing.assert_array_equal(int8, plain)
            continue
        want = moe(x, logits, np.concatenate([gate_f, up_f], axis=1), down_f, top_k, True)
        scale = np.abs(want).max()
        assert np.abs(plain - want).max() <= 2e-5 * scale
        if exact_x:
            assert np.abs(int8 - want).max() <= 2e-5 * scale
        else:
            assert not np.array_equal(int8, plain)
            rms = float(np.sqrt(np.mean(want ** 2)))
            assert float(np.sqrt(np.mean((int8 - want) ** 2))) <= 0.04 * rms


@pytest.mark.parametrize("block_size", [64, 256])
def test_blocks_of_several_32_groups(block_size: int) -> None:
    """4-bit blocks longer than 32 (an int4 export's --quant-block-size 64, or larger): each 32-group of x keeps
    its own scale inside the block, the block's weight scale and zero point apply once (the kernel's general
    branch; GGUF's blocks of 32 take the one-group branch the other tests cover)."""
    from octavo.export.gguf_blocks import Blocks

    n, k = 23, 512
    nb = k // block_size
    rng = np.random.default_rng(block_size)
    codes = rng.integers(0, 16, (n, nb, block_size)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.2, (n, nb)).astype(np.float32)
    zero = rng.integers(0, 16, (n, nb)).astype(np.uint8)
    blocks = Blocks(codes, scales, zero, None, 4, ("test",))
    w = blocks.dequantize()
    bias = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal((37, k)) * rng.uniform(0.1, 10, (37, 1))).astype(np.float32)
    _check_int8(_session(panel_weights(blocks), bias, decode=False, prompt_int8=1), x, blocks, w, bias)
