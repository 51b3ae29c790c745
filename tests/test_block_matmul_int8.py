"""octavo.BlockMatMul's int8 path (nodes with prompt_int8 = 1 or decode_int8 = 1; plugins/onnxruntime/block_matmul_int8.cc)
against a numpy reference of the same rounding of x, and against x @ W^T.

The reference (independent of the kernel): x rounded to int8 per row and 32 values (q = rint(clip(x * (127 /
max|x|), -127, 127)) in float32, s = max|x| / 127), the integer sums of q times the layout's codes (exact, in int64),
then y = sum over blocks of scale * sum over the block's groups of s * isum + offset * sum(x) + bias in float64. The
op forms the same integers and does the float32 scaling: within (nb * groups + 8) u of the magnitudes it adds.
Against the float32 product the difference is x's rounding: |dx| <= max|x| / 254 per group (times |code * scale|).
Which steps take it: prompt_int8, 4-bit codes (Q4_0, Q4_1, Q4_K) in blocks of a multiple of 32, past 8 rows, not
decode-only (8-bit codes and the 16-bit path's steps keep their paths, the same bits as without it); decode_int8,
the 16-bit path's steps (<= 8 rows, decode-only steps), on those 4-bit codes and on 8-bit codes below 64 (Q6_K's
blocks of 16, Q5_x's of 32; Q8_0 keeps the 16-bit path).
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
    if bs >= 32:  # per 32-group integer sums times the group's s, summed per block
        codes = blocks.codes.astype(np.int64).reshape(n, k // 32, 32)
        isum = np.einsum("rgk,ngk->rng", q.reshape(rows, k // 32, 32).astype(np.int64), codes)  # exact
        scaled = (isum * s[:, None, :].astype(np.float64)).reshape(rows, n, nb, bs // 32).sum(axis=3)
    else:  # blocks of 16 (Q6_K): per block integer sums times the s of the group that holds the block
        isum = np.einsum("rbk,nbk->rnb", q.reshape(rows, nb, bs).astype(np.int64), blocks.codes.astype(np.int64))
        scaled = isum * s[:, None, (np.arange(nb) * bs) // 32].astype(np.float64)
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
    bound = (nb * max(1, blocks.block_size // 32) + 3 * 32 + 16) * U * magnitude + 1e-30
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


@pytest.mark.parametrize("type_name,n,k", [("Q4_0", 37, 544), ("Q4_K", 40, 2048)])
@pytest.mark.parametrize("rows,decode", [(1, True), (1, False), (2, False), (5, True), (8, False), (9, True),
                                         (13, True), (48, True)])
def test_decode_int8_takes_the_sixteen_bit_steps(type_name: str, n: int, k: int, rows: int, decode: bool) -> None:
    """decode_int8 = 1: the steps the 16-bit path would take (<= 8 rows, decode-only steps of any size) take the
    int8 path instead: the reference's numbers, and each row's bits are the same alone as in its step (a decode
    step of one row, a verification step of 5, a decode batch of 48); with prompt_int8 too, the same bits as a
    prompt step's (one arithmetic per row whatever the step)."""
    blocks, w = _blocks(type_name, n, k, seed=rows + 3)
    rng = np.random.default_rng(rows)
    bias = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 30, (rows, 1))).astype(np.float32)
    x[0, 32:64] = 0  # an all-zero group
    got = _check_int8(_session(panel_weights(blocks), bias, decode=decode, decode_int8=1), x, blocks, w, bias)
    plain = _session(panel_weights(blocks), bias, decode=decode).run(None, {"x": x})[0]
    assert not np.array_equal(got.astype(np.float32), plain)  # not the 16-bit path's bits
    alone = _session(panel_weights(blocks), bias, decode=True, decode_int8=1)
    for r in {0, rows // 2, rows - 1}:
        np.testing.assert_array_equal(alone.run(None, {"x": x[r:r + 1]})[0][0], got[r].astype(np.float32))
    prompt = _session(panel_weights(blocks), bias, decode=False, prompt_int8=1)  # a 9-row prompt step holding row 0
    np.testing.assert_array_equal(prompt.run(None, {"x": np.repeat(x[:1], 9, axis=0)})[0][4], got[0].astype(np.float32))


@pytest.mark.parametrize("rows,decode", [(20, False), (301, False)])
def test_decode_int8_leaves_prompt_steps_alone(rows: int, decode: bool) -> None:
    """A step past 8 rows that is not decode-only keeps the float32 path under decode_int8 (prompt_int8 is its
    own switch)."""
    blocks, w = _blocks("Q4_K", 24, 512, seed=5)
    x = np.random.default_rng(6).standard_normal((rows, 512)).astype(np.float32)
    a = _session(panel_weights(blocks), decode=decode, decode_int8=1).run(None, {"x": x})[0]
    b = _session(panel_weights(blocks), decode=decode).run(None, {"x": x})[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("type_name,n,k", [("Q6_K", 37, 512), ("Q5_0", 19, 96), ("Q5_1", 40, 544), ("Q5_K", 33, 768)])
@pytest.mark.parametrize("rows,decode", [(1, True), (2, False), (5, True), (48, True)])
def test_decode_int8_takes_8bit_codes_below_64(type_name: str, n: int, k: int, rows: int, decode: bool) -> None:
    """8-bit codes below 64 (Q6_K's blocks of 16, Q5_x's of 32) on decode_int8 steps: the reference's numbers
    (int8_tile8: codes interleaved by 16 bits, four k of a column per vpmaddubsw lane), a row's bits the same alone
    as in its step; their prompt steps keep the float32 path even with prompt_int8."""
    blocks, w = _blocks(type_name, n, k, seed=rows + 11)
    assert blocks.bits == 8 and blocks.codes.max() < 64
    rng = np.random.default_rng(rows + 1)
    bias = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 30, (rows, 1))).astype(np.float32)
    x[0, :32] = 0
    got = _check_int8(_session(panel_weights(blocks), bias, decode=decode, decode_int8=1), x, blocks, w, bias)
    assert not np.array_equal(got.astype(np.float32), _session(panel_weights(blocks), bias, decode=decode).run(
        None, {"x": x})[0])
    alone = _session(panel_weights(blocks), bias, decode=True, decode_int8=1)
    for r in {0, rows - 1}:
        np.testing.assert_array_equal(alone.run(None, {"x": x[r:r + 1]})[0][0], got[r].astype(np.float32))
    prompt_x = np.repeat(x[:1], 12, axis=0)
    a = _session(panel_weights(blocks), bias, decode=False, decode_int8=1, prompt_int8=1).run(None, {"x": prompt_x})[0]
    b = _session(panel_weights(blocks), bias, decode=False).run(None, {"x": prompt_x})[0]
    np.testing.assert_array_equal(a, b)


def test_decode_int8_leaves_8bit_blocks_of_64_on_sixteen_bits() -> None:
    """8-bit codes below 64 in blocks of 64 (an int8 export's --quant-block-size 64 could hold them): not the 8-bit
    int8 tile's layout (one activation scale a block), so the 16-bit path, bit for bit."""
    from octavo.export.gguf_blocks import Blocks

    rng = np.random.default_rng(5)
    codes = rng.integers(0, 64, (21, 4, 64)).astype(np.uint8)
    blocks = Blocks(codes, rng.uniform(0.01, 0.2, (21, 4)).astype(np.float32), np.full((21, 4), 32, np.uint8), None,
                    8, ("test",))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    a = _session(panel_weights(blocks), decode=True, decode_int8=1).run(None, {"x": x})[0]
    b = _session(panel_weights(blocks), decode=True).run(None, {"x": x})[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rows", [1, 12])
def test_decode_int8_leaves_codes_of_64_and_more_on_sixteen_bits(rows: int) -> None:
    """Q8_0's codes (q + 128) and a Q5_1 layer with one code pushed past 63 (a crafted file): the 16-bit path, bit
    for bit (vpmaddubsw's int16 sums would not hold them)."""
    for type_name, k in (("Q8_0", 96), ("Q5_1", 64)):
        blocks, w = _blocks(type_name, 19, k, seed=3)
        pw = panel_weights(blocks)
        if type_name == "Q5_1":
            pw.codes[1, 5, 7] |= 0x40
        x = np.random.default_rng(4).standard_normal((rows, k)).astype(np.float32)
        a = _session(pw, decode=True, decode_int8=1, prompt_int8=1).run(None, {"x": x})[0]
        b = _session(pw, decode=True).run(None, {"x": x})[0]
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rows,bad,decode,attr", [(20, 17, False, "prompt_int8"), (3, 1, True, "decode_int8")])
def test_non_finite_x_takes_the_float32_path(rows: int, bad: int, decode: bool, attr: str) -> None:
    """inf / nan in a prompt's (or a decode step's) x: the step refuses int8 and propagates them as float32 does."""
    blocks, w = _blocks("Q4_0", 16, 64)
    x = np.random.default_rng(9).standard_normal((rows, 64)).astype(np.float32)
    x[bad, 3] = np.inf if attr == "prompt_int8" else np.nan
    got = _session(panel_weights(blocks), decode=decode, **{attr: 1}).run(None, {"x": x})[0]
    plain = _session(panel_weights(blocks), decode=decode).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, plain)
    finite = np.ones(rows, bool)
    finite[bad] = False
    assert (np.abs(got[finite] - _want(x[finite], w, None)) <= _float_bound(x[finite], w, None)).all()


def test_bad_attribute_is_refused() -> None:
    blocks, _ = _blocks("Q4_0", 16, 64)
    with pytest.raises(Exception, match="prompt_int8 must be 0 or 1"):
        _session(panel_weights(blocks), prompt_int8=2)
    with pytest.raises(Exception, match="decode_int8 must be 0 or 1"):
        _session(panel_weights(blocks), decode_int8=-1)


def _check_knob(model: str, field: str, bad: str) -> None:
    """EngineArgs FIELD refuses BAD and any backend but onnxruntime, and its flag sets it to int8."""
    import argparse
    import dataclasses

    from octavo.commands.serve import add_engine_arguments, engine_args
    from octavo.errors import InvalidRequestError
    from octavo.runtime.engine_args import EngineArgs

    with pytest.raises(InvalidRequestError, match=f"{field} must be one of"):
        EngineArgs(model=model, **{field: bad}).validate()
    with pytest.raises(InvalidRequestError, match="onnxruntime backend"):
        dataclasses.replace(EngineArgs(model=model), backend="tensorrt", **{field: "int8"}).validate()
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("model")
    add_engine_arguments(parser)
    assert getattr(engine_args(parser.parse_args(["m", "--" + field.replace("_", "-"), "int8"])), field) == "int8"


def test_engine_prompt_activations_int8(hf_model_dir, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """EngineArgs.prompt_activations = "int8" on a Q4_0 GGUF: the loaded graph's 4-bit BlockMatMul nodes carry
    prompt_int8 = 1, a prompt's logits move by the rounding of x only (close to float32's, not equal), decode-only
    steps run the 16-bit path as before, and the knob is refused where it cannot apply."""
    from octavo import LLM, SamplingParams
    from octavo.export.gguf_writer import write_gguf

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
    _check_knob(str(path), "prompt_activations", "fp8")


def test_set_prompt_int8_marks_only_4bit_blocks_of_32() -> None:
    from onnx import helper

    from octavo.runtime.backends.ort_fusions import set_int8_activations as set_prompt_int8

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
    # decode steps: 8-bit codes too (in blocks of 16 or 32; the op checks that they are below 64)
    assert set_prompt_int8(model, "decode") == 5  # (8, 32) and the MoE with 8-bit experts join
    marked = [any(a.name == "decode_int8" and a.i == 1 for a in n.attribute) for n in model.graph.node]
    assert marked == [True, True, False, True, False, True, True, False]


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


def _moe_experts(gu_type: str, down_type: str, experts: int, hidden: int):  # noqa: ANN202
    """(stacked gate/up, stacked down, inter, gate/up float [E, 2I, H], down float) of random quantized experts."""
    from test_moe_op import _quantized_experts

    from octavo.export.moe_blocks import stack_experts

    inter = 256 if down_type.endswith("_K") else 96
    gate, gate_f = _quantized_experts(gu_type, experts, inter, hidden, 1)
    up, up_f = _quantized_experts(gu_type, experts, inter, hidden, 2)
    down, down_f = _quantized_experts(down_type, experts, hidden, inter, 3)
    return (stack_experts([[gate[e], up[e]] for e in range(experts)]), stack_experts([[d] for d in down]), inter,
            np.concatenate([gate_f, up_f], axis=1), down_f)


def _moe_x(rng: np.random.Generator, tokens: int, hidden: int, exact_x: bool) -> np.ndarray:
    """x for the MoE tests; EXACT_X: each 32-group's max is 127 * 2^-7 and the rest multiples of 2^-7, so rounding
    to int8 loses nothing."""
    if not exact_x:
        return rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
    x = rng.integers(-127, 128, (tokens, hidden)).astype(np.float32)
    x[:, ::32] = 127  # each group's max: its scale is exactly 1
    return x * np.float32(2.0 ** -7)


@pytest.mark.parametrize(("gu_type", "down_type", "exact_x"), [("Q4_0", "Q4_1", False), ("Q4_K", "Q6_K", True)])
def test_moe_experts_take_the_int8_path(gu_type: str, down_type: str, exact_x: bool) -> None:
    """octavo.MoE with prompt_int8 = 1: a prompt chunk's 4-bit experts take the int8 path; 8-bit experts (Q6_K's
    down), decode-only steps and steps of <= 8 tokens keep their paths bit for bit. EXACT_X: every 32-group of x is
    k / 127 of its largest value (k integer), so rounding it to int8 loses nothing and the int8 gate/up (Q4_K) then
    down (Q6_K, float32) must give the float reference to float32 rounding; otherwise both stages round (Q4_0, Q4_1)
    and the outputs move by ~2 % of their RMS, where a wrong code, scale or row would move them by ~100 %."""
    from moe_reference import moe
    from test_moe_op import _block_session, _run

    experts, hidden, top_k = 6, 256, 2
    gate_up, stacked_down, inter, gate_up_f, down_f = _moe_experts(gu_type, down_type, experts, hidden)
    rng = np.random.default_rng(7)
    for tokens, decode in ((40, False), (40, True), (6, False)):
        x = _moe_x(rng, tokens, hidden, exact_x)
        logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
        plain = _run(_block_session(gate_up, stacked_down, inter, top_k, True, decode), x, logits)
        int8 = _run(_block_session(gate_up, stacked_down, inter, top_k, True, decode, prompt_int8=1), x, logits)
        if decode or tokens <= MAX_INT_ROWS:
            np.testing.assert_array_equal(int8, plain)
            continue
        want = moe(x, logits, gate_up_f, down_f, top_k, True)
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


@pytest.mark.parametrize(("gu_type", "down_type", "exact_x"),
                         [("Q4_0", "Q4_1", False), ("Q4_K", "Q6_K", False), ("Q4_K", "Q8_0", True)])
def test_moe_experts_take_the_int8_path_on_decode_steps(gu_type: str, down_type: str, exact_x: bool) -> None:
    """octavo.MoE with decode_int8 = 1: decode-only steps and steps of <= 8 tokens run their 4-bit experts and 8-bit
    experts below 64 (Q6_K) on the int8 path (Q8_0's codes keep the 16-bit path), a prompt chunk keeps its path bit
    for bit, and a token's output is the same bits alone as in a decode batch of 40. EXACT_X as in the prompt test
    above: with Q8_0's down on the 16-bit path, the int8 gate/up must add no error of its own."""
    from moe_reference import moe
    from test_moe_op import _block_session, _run

    experts, hidden, top_k = 6, 256, 2
    gate_up, stacked_down, inter, gate_up_f, down_f = _moe_experts(gu_type, down_type, experts, hidden)
    rng = np.random.default_rng(8)
    for tokens, decode in ((40, True), (6, False), (40, False)):
        x = _moe_x(rng, tokens, hidden, exact_x)
        logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
        plain = _run(_block_session(gate_up, stacked_down, inter, top_k, True, decode), x, logits)
        session = _block_session(gate_up, stacked_down, inter, top_k, True, decode, decode_int8=1)
        int8 = _run(session, x, logits)
        if not decode and tokens > MAX_INT_ROWS:
            np.testing.assert_array_equal(int8, plain)
            continue
        want = moe(x, logits, gate_up_f, down_f, top_k, True)
        scale = np.abs(want).max()
        assert not np.array_equal(int8, plain)
        if exact_x:  # gate/up on int8 (x exact in it): no worse than the 16-bit path (down, Q8_0, rounds on both)
            assert np.abs(int8 - want).max() <= 2 * np.abs(plain - want).max() + 2e-5 * scale
        else:
            rms = float(np.sqrt(np.mean(want ** 2)))
            assert float(np.sqrt(np.mean((int8 - want) ** 2))) <= 0.04 * rms
        one = _block_session(gate_up, stacked_down, inter, top_k, True, True, decode_int8=1)
        for t in (0, tokens - 1):
            np.testing.assert_array_equal(_run(one, x[t:t + 1], logits[t:t + 1])[0], int8[t])


def test_engine_decode_activations_int8(hf_model_dir, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """EngineArgs.decode_activations = "int8" on a Q4_0 GGUF: decode steps take the int8 path (their logprobs move,
    the prompt step's do not), speculation stays token for token and logprob for logprob the output without it
    (verification rows run decode's per-row arithmetic), and the knob is refused where it cannot apply."""
    from test_spec_decode_engine import ReferenceDrafts

    from octavo import LLM, SamplingParams
    from octavo.export.gguf_writer import write_gguf

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q4_0.gguf", tensor_type="Q4_0")
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(5, 300, n)] for n in (30, 17, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    runs = {}
    for name, options in (("int16", {}), ("int8", {"decode_activations": "int8"}),
                          ("int8+spec", {"decode_activations": "int8", "speculative_config": spec})):
        llm = LLM(str(path), num_threads=2, **options)
        if "spec" in name:  # drafts of int8's own output, every 5th wrong: runs accepted, some cut short
            llm.engine.scheduler.proposer = ReferenceDrafts({tuple(p): r[0] for p, r in zip(prompts, runs["int8"])})
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]  # one at a time
        runs[name] = [(o.outputs[0].token_ids, [next(iter(e.values())).logprob for e in o.outputs[0].logprobs],
                       [next(iter(e.values())).logprob for e in o.prompt_logprobs[1:]]) for o in outs]
        if "spec" in name:
            st = llm.engine.stats()
            assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
        llm.close()
    for got, want in zip(runs["int8+spec"], runs["int8"]):  # verification rows: decode's arithmetic, row for row
        assert got[0] == want[0] and got[1] == want[1]
    for (t16, lp16, pp16), (t8, lp8, pp8) in zip(runs["int16"], runs["int8"]):
        assert pp8 == pp16  # the prompt's step (30+ rows) keeps the float32 path
        assert lp8[0] == lp16[0] and t8[0] == t16[0]  # the first token comes from that step too
        assert t8 != t16 or np.abs(np.array(lp8) - np.array(lp16)).max() > 1e-4  # decode steps: int8's numbers
    _check_knob(str(path), "decode_activations", "int4")


def test_smollm2_int8_decode_against_int16() -> None:
    """On the embedded SmolLM2 Q4_1 GGUF, ~600 tokens scored in steps of 8 (the steps decode_activations governs,
    as decode and verification are): int8 picks the 16-bit path's top-1 token at >= 94 % of the positions and moves
    the actual next token's logprob by < 0.15 on average (measured: 96.5 %, 0.078, at most 2.8; docs/quantization.md)."""
    from benchmarks.kv_accuracy import forced_runs

    rows = forced_runs("smollm2-135m-instruct", {m: {"decode_activations": m} for m in ("int16", "int8")}, chunk=8)
    change = np.abs(np.array([lp for _, lp in rows["int8"]]) - np.array([lp for _, lp in rows["int16"]]))
    agree = np.mean([a == b for (a, _), (b, _) in zip(rows["int16"], rows["int8"])])
    assert agree >= 0.94 and 0 < change.mean() < 0.15, (agree, change.mean(), change.max())
