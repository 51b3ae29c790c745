"""octavo.MoE (plugins/onnxruntime/moe_kernel.h) run by a real onnxruntime session against the numpy reference
(tests/moe_reference.py): routing (softmax, top-k, ties, renormalisation), experts no token picks, every token
on one expert, one token and long steps, batch invariance, and bad shapes as clear errors."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from moe_reference import moe, route
from onnx import TensorProto, helper, numpy_helper
from op_cases import one_node_session
from test_gguf_native import _raw_blocks, _reference

from octavo.export.gguf_blocks import Blocks, parse_blocks
from octavo.export.moe_blocks import StackedPanels, stack_experts

ATOL = 2e-5
XL = [("x", TensorProto.FLOAT), ("logits", TensorProto.FLOAT)]  # the node's graph inputs


def _session(gate_up: np.ndarray, down: np.ndarray, top_k: int, normalize: bool,
             threads: int = 2) -> ort.InferenceSession:
    """One MoE node, x and the router logits as graph inputs, the experts as initializers."""
    node = helper.make_node("MoE", ["x", "logits", "gate_up", "down"], ["y"], domain="octavo", top_k=top_k,
                            normalize=int(normalize))
    return one_node_session(node, XL, ["y"], [numpy_helper.from_array(gate_up, "gate_up"),
                                              numpy_helper.from_array(down, "down")], threads)


def _experts(rng: np.random.Generator, experts: int, hidden: int, inter: int) -> tuple[np.ndarray, np.ndarray]:
    gate_up = rng.normal(0, 0.3, (experts, 2 * inter, hidden)).astype(np.float32)
    down = rng.normal(0, 0.3, (experts, hidden, inter)).astype(np.float32)
    return gate_up, down


def _run(session: ort.InferenceSession, x: np.ndarray, logits: np.ndarray) -> np.ndarray:
    return session.run(None, {"x": x.astype(np.float32), "logits": logits.astype(np.float32)})[0]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "normalize"),
                         [(1, 8, 2, True), (5, 8, 2, False), (37, 16, 4, True), (300, 6, 1, False), (9, 4, 4, True)])
def test_matches_the_reference(tokens: int, experts: int, top_k: int, normalize: bool) -> None:
    rng = np.random.default_rng(tokens)
    hidden, inter = 40, 24  # not multiples of the kernel's 16 lanes or 64 columns
    gate_up, down = _experts(rng, experts, hidden, inter)
    x = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
    logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
    y = _run(_session(gate_up, down, top_k, normalize), x, logits)
    want = moe(x, logits, gate_up, down, top_k, normalize)
    assert y.shape == (tokens, hidden) and y.dtype == np.float32
    np.testing.assert_allclose(y, want, atol=ATOL, rtol=1e-5)
    # the test sees the routing: the other renormalisation (which changes nothing when every expert is chosen),
    # or one expert fewer, is far off
    if top_k < experts:
        assert np.abs(moe(x, logits, gate_up, down, top_k, not normalize) - y).max() > 1e-2
    if top_k > 1:
        assert np.abs(moe(x, logits, gate_up, down, top_k - 1, normalize) - y).max() > 1e-2


def test_ties_go_to_the_lower_expert_index() -> None:
    """Equal logits: the lower indices win, whichever expert the tie sits on."""
    rng = np.random.default_rng(1)
    gate_up, down = _experts(rng, 6, 32, 16)
    x = rng.normal(0, 1, (4, 32)).astype(np.float32)
    logits = np.array([[0, 0, 0, 0, 0, 0],          # all tied: experts 0, 1
                       [1, 3, 3, 3, 0, 0],          # three tied for first: 1, 2
                       [5, 2, 2, 0, 2, 5],          # tied first (0, 5) in any case
                       [0, 0, 0, 0, 1, 1]], np.float32)  # tied last pick
    experts, _ = route(logits, 2, True)
    assert experts.tolist() == [[0, 1], [1, 2], [0, 5], [4, 5]]
    y = _run(_session(gate_up, down, 2, True), x, logits)
    np.testing.assert_allclose(y, moe(x, logits, gate_up, down, 2, True), atol=ATOL, rtol=1e-5)
    # expert 3 instead of 2 for row 1 (the other tie order) is visibly different
    other = moe(x[1:2], np.array([[1, 3, 2, 3, 0, 0]], np.float32), gate_up, down, 2, True)
    assert np.abs(other - y[1:2]).max() > 1e-2


def test_unpicked_experts_and_all_tokens_on_one_expert() -> None:
    rng = np.random.default_rng(2)
    gate_up, down = _experts(rng, 8, 32, 16)
    x = rng.normal(0, 1, (50, 32)).astype(np.float32)
    logits = np.full((50, 8), -4.0, np.float32)
    logits[:, 6] = 8.0  # every token: expert 6 first, then expert 2 (experts 0, 1, 3, 4, 5, 7 idle)
    logits[:, 2] = 7.0
    logits[::2, 2] += rng.normal(0, 0.1, 25).astype(np.float32)
    session = _session(gate_up, down, 2, False)
    np.testing.assert_allclose(_run(session, x, logits), moe(x, logits, gate_up, down, 2, False), atol=ATOL, rtol=1e-5)
    one = _session(gate_up, down, 1, True)  # top-1 renormalised: weight exactly 1
    y = _run(one, x, logits)
    np.testing.assert_allclose(y, moe(x, logits, gate_up, down, 1, True), atol=ATOL, rtol=1e-5)


def test_a_token_is_the_same_alone_or_in_any_batch() -> None:
    """Batch invariance, bit for bit: a token's output does not depend on the other tokens of the step or on
    the number of threads."""
    rng = np.random.default_rng(3)
    gate_up, down = _experts(rng, 8, 48, 80)
    x = rng.normal(0, 1, (70, 48)).astype(np.float32)
    logits = rng.normal(0, 2, (70, 8)).astype(np.float32)
    batched = _run(_session(gate_up, down, 2, True), x, logits)
    single = _session(gate_up, down, 2, True, threads=1)
    for t in (0, 17, 69):
        assert np.array_equal(_run(single, x[t:t + 1], logits[t:t + 1]), batched[t:t + 1])
    perm = rng.permutation(70)
    assert np.array_equal(_run(single, x[perm], logits[perm]), batched[perm])


def test_empty_step() -> None:
    rng = np.random.default_rng(4)
    gate_up, down = _experts(rng, 4, 16, 8)
    y = _run(_session(gate_up, down, 2, True), np.zeros((0, 16)), np.zeros((0, 4)))
    assert y.shape == (0, 16)


def test_bad_shapes_and_attributes_are_clear_errors() -> None:
    rng = np.random.default_rng(5)
    gate_up, down = _experts(rng, 4, 16, 8)
    session = _session(gate_up, down, 2, True)
    with pytest.raises(Exception, match=r"octavo.MoE: router_logits must be \[T, E\] with T = 3"):
        _run(session, np.zeros((3, 16)), np.zeros((2, 4)))
    with pytest.raises(Exception, match=r"octavo.MoE: gate_up must be \[E, 2I, H\] with E = 5"):
        _run(session, np.zeros((3, 16)), np.zeros((3, 5)))
    with pytest.raises(Exception, match=r"octavo.MoE: gate_up must be \[E, 2I, H\]"):
        _run(session, np.zeros((3, 12)), np.zeros((3, 4)))
    with pytest.raises(Exception, match="top_k 5 exceeds the 4 experts"):
        _run(_session(gate_up, down, 5, True), np.zeros((3, 16)), np.zeros((3, 4)))
    with pytest.raises(Exception, match="down must be"):
        _run(_session(gate_up, down[:, :, :4].copy(), 2, True), np.zeros((3, 16)), np.zeros((3, 4)))
    with pytest.raises(Exception, match="top_k must be a positive integer"):
        _session(gate_up, down, 0, True)


# ----------------------------------------------------------------------------- block-quantized experts (GGUF's own)
def _block_session(gate_up: StackedPanels, down: StackedPanels, inter: int, top_k: int, normalize: bool,
                   decode: bool | None, **attrs: int) -> ort.InferenceSession:
    """One MoE node over stacked panels, as octavo/export/moe_graph.py writes it (ATTRS: more attributes)."""
    names = ["x", "logits", "gu_codes", "down_codes", "gu_scales", "gu_offsets", "down_scales", "down_offsets"]
    arrays = [gate_up.codes, down.codes, gate_up.scales, gate_up.offsets, down.scales, down.offsets]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(arrays, names[2:])]
    if decode is not None or gate_up.scale_super is not None or down.scale_super is not None:
        names.append("decode_step" if decode is not None else "")
    if decode is not None:
        inits.append(numpy_helper.from_array(np.array([decode]), "decode_step"))
    for name, panels in (("gu", gate_up), ("down", down)):  # inputs 9-12: two-level scales (K-quants)
        if panels.scale_super is None:
            names += ["", ""]
            continue
        names += [name + "_scale_super", name + "_offset_super"]
        inits += [numpy_helper.from_array(panels.scale_super, name + "_scale_super"),
                  numpy_helper.from_array(panels.offset_super, name + "_offset_super")]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("MoE", names, ["y"], domain="octavo", top_k=top_k, normalize=int(normalize),
                            expert_inter=inter, gate_up_bits=gate_up.bits, gate_up_block_size=gate_up.block_size,
                            down_bits=down.bits, down_block_size=down.block_size, **attrs)
    return one_node_session(node, XL, ["y"], inits)


def _quantized_experts(type_name: str, experts: int, n: int, k: int, seed: int) -> tuple[list[Blocks], np.ndarray]:
    """EXPERTS [n, k] weights of a GGML type, as one 3-D GGUF tensor's rows: (per-expert Blocks, float32 values)."""
    raw = _raw_blocks(type_name, experts * n, k, seed)
    blocks = parse_blocks(type_name, raw, experts * n, k)
    assert blocks is not None
    values = _reference(type_name, raw, experts * n, k).reshape(experts, n, k)
    return [blocks.rows(slice(e * n, (e + 1) * n)) for e in range(experts)], values


@pytest.mark.parametrize(("gu_type", "down_type", "tokens", "decode"), [
    ("Q8_0", "Q8_0", 1, True), ("Q4_K", "Q6_K", 1, True), ("Q4_0", "Q8_0", 5, False),  # 16-bit path (<= 8 rows)
    ("Q4_K", "Q6_K", 40, False), ("Q8_0", "Q4_1", 21, False),  # float32 path: a prompt chunk
    ("Q4_K", "Q6_K", 24, True),  # a decode step of 24 sequences: the 16-bit path past 8 rows
])
def test_block_experts_match_the_reference_on_the_files_values(gu_type: str, down_type: str, tokens: int,
                                                               decode: bool) -> None:
    """The experts in the file's own blocks: y == the reference over the file's float32 values, within the float32
    path's rounding (prompt chunks) or the 16-bit activations' 2^-16 (decode-only steps and steps of <= 8 rows; two
    rounded stages, measured <= 9e-5 of the largest output), and bit-identical for a token alone and in its step."""
    experts, hidden, inter, top_k = 6, 256, 96, 2  # K-quants need K a multiple of 256: down's K = inter uses 32-blocks
    if down_type.endswith("_K"):
        inter = 256
    gate, gate_f = _quantized_experts(gu_type, experts, inter, hidden, 1)
    up, up_f = _quantized_experts(gu_type, experts, inter, hidden, 2)
    down, down_f = _quantized_experts(down_type, experts, hidden, inter, 3)
    gate_up = stack_experts([[gate[e], up[e]] for e in range(experts)])
    stacked_down = stack_experts([[down[e]] for e in range(experts)])
    rng = np.random.default_rng(tokens)
    x = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
    logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
    y = _run(_block_session(gate_up, stacked_down, inter, top_k, True, decode), x, logits)
    want = moe(x, logits, np.concatenate([gate_f, up_f], axis=1), down_f, top_k, True)
    integer = decode or tokens <= 8
    scale = np.abs(want).max()
    assert np.abs(y - want).max() <= (2e-4 if integer else 2e-5) * scale
    # batch invariance: each token alone (a decode step of one) gives the same bits as in its step when the step
    # took the same path
    alone = _block_session(gate_up, stacked_down, inter, top_k, True, decode)
    if integer:
        for t in (0, tokens - 1):
            assert np.array_equal(_run(alone, x[t:t + 1], logits[t:t + 1]), y[t:t + 1])


def test_block_experts_bad_inputs_are_clear_errors() -> None:
    gate, _ = _quantized_experts("Q8_0", 4, 32, 64, 1)
    down, _ = _quantized_experts("Q8_0", 4, 64, 32, 2)
    gate_up = stack_experts([[gate[e], gate[e]] for e in range(4)])
    stacked_down = stack_experts([[down[e]] for e in range(4)])
    session = _block_session(gate_up, stacked_down, 32, 2, True, None)
    with pytest.raises(Exception, match=r"octavo.MoE: gate_up codes must be uint8 \[5, 4, 32, 32\]"):
        _run(session, np.zeros((2, 64)), np.zeros((2, 5)))
    wrong_inter = _block_session(gate_up, stacked_down, 48, 2, True, None)
    with pytest.raises(Exception, match="octavo.MoE: gate_up codes must be uint8"):
        _run(wrong_inter, np.zeros((2, 64)), np.zeros((2, 4)))
    assert _run(session, np.zeros((0, 64)), np.zeros((0, 4))).shape == (0, 64)


def test_a_long_step_runs_in_passes_with_the_same_results() -> None:
    """Steps past 1,024 tokens (the op's pass size, which bounds its scratch) give each token the same bits as a step
    of that token alone on the same path: float experts, and block experts on both paths."""
    rng = np.random.default_rng(6)
    tokens, experts, hidden, inter = 1100, 4, 32, 32
    gate_up, down = _experts(rng, experts, hidden, inter)
    x = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
    logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
    y = _run(_session(gate_up, down, 2, True), x, logits)
    np.testing.assert_allclose(y, moe(x, logits, gate_up, down, 2, True), atol=ATOL, rtol=1e-5)
    for t in (0, 1023, 1024, 1099):
        assert np.array_equal(_run(_session(gate_up, down, 2, True, threads=1), x[t:t + 1], logits[t:t + 1]), y[t:t + 1])
    gate, _ = _quantized_experts("Q8_0", experts, 2 * inter, hidden, 7)
    down_blocks, _ = _quantized_experts("Q8_0", experts, hidden, inter, 8)
    stacked = stack_experts([[g] for g in gate]), stack_experts([[d] for d in down_blocks])
    for decode in (True, False):
        session = _block_session(*stacked, inter, 2, True, decode)
        y = _run(session, x, logits)
        first, last = _run(session, x[:1024], logits[:1024]), _run(session, x[1024:], logits[1024:])
        assert np.array_equal(y, np.concatenate([first, last]))
        if decode:  # the 16-bit path at any size: a token alone is bit-identical
            assert np.array_equal(_run(session, x[1030:1031], logits[1030:1031]), y[1030:1031])


def _one_level(p: StackedPanels) -> StackedPanels:
    """P's two-level scales multiplied out to float32 (the layout before two-level scales)."""
    per_super = 256 // p.block_size
    block = np.arange(p.scales.shape[2]) // per_super
    scales = (p.scales.astype(np.float32) * p.scale_super[:, :, block]).astype(np.float32)
    offsets = (p.offsets.astype(np.float32) * p.offset_super[:, :, block]).astype(np.float32)
    return StackedPanels(p.codes, scales, offsets, p.bits, p.block_size, p.types)


@pytest.mark.parametrize("tokens,decode", [(1, True), (5, False), (24, True), (40, False)])
def test_two_level_expert_scales_give_the_one_level_values(tokens: int, decode: bool) -> None:
    """K-quant experts keep the file's two-level scales (int8 x float32 per 256 of K, moe_blocks.h): the same
    outputs, value for value, as their scales multiplied out to float32, on the decode and prompt paths."""
    experts, hidden, inter, top_k = 6, 512, 256, 2
    gate, _ = _quantized_experts("Q4_K", experts, inter, hidden, 31)
    up, _ = _quantized_experts("Q4_K", experts, inter, hidden, 32)
    down, _ = _quantized_experts("Q6_K", experts, hidden, inter, 33)
    gate_up = stack_experts([[gate[e], up[e]] for e in range(experts)])
    stacked_down = stack_experts([[down[e]] for e in range(experts)])
    assert gate_up.scales.dtype == stacked_down.scales.dtype == np.int8
    assert gate_up.scale_super.shape == (experts, 2 * inter // 16, hidden // 256, 16)
    rng = np.random.default_rng(tokens)
    x = rng.normal(0, 1, (tokens, hidden)).astype(np.float32)
    logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
    two = _run(_block_session(gate_up, stacked_down, inter, top_k, True, decode), x, logits)
    one = _run(_block_session(_one_level(gate_up), _one_level(stacked_down), inter, top_k, True, decode), x, logits)
    np.testing.assert_array_equal(two, one)
