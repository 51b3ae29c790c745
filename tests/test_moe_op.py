"""octavo.MoE (plugins/onnxruntime/moe_kernel.h) run by a real onnxruntime session against the numpy reference
(tests/moe_reference.py): routing (softmax, top-k, ties, renormalisation), experts no token picks, every token
on one expert, one token and long steps, batch invariance, and bad shapes as clear errors."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from moe_reference import moe, route
from onnx import TensorProto, helper, numpy_helper

from octavo.runtime.backends.oplib import library_path

ATOL = 2e-5


def _session(gate_up: np.ndarray, down: np.ndarray, top_k: int, normalize: bool,
             threads: int = 2) -> ort.InferenceSession:
    """One MoE node, x and the router logits as graph inputs, the experts as initializers."""
    node = helper.make_node("MoE", ["x", "logits", "gate_up", "down"], ["y"], domain="octavo", top_k=top_k,
                            normalize=int(normalize))
    graph = helper.make_graph(
        [node], "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(gate_up, "gate_up"), numpy_helper.from_array(down, "down")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("octavo", 1)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library_path()))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


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
    with pytest.raises(Exception, match=r"octavo.MoE: router_logits must be \[T, E\]"):
        _run(session, np.zeros((3, 16)), np.zeros((3, 5)))
    with pytest.raises(Exception, match=r"octavo.MoE: gate_up must be \[E, 2I, H\]"):
        _run(session, np.zeros((3, 12)), np.zeros((3, 4)))
    with pytest.raises(Exception, match="top_k 5 exceeds the 4 experts"):
        _run(_session(gate_up, down, 5, True), np.zeros((3, 16)), np.zeros((3, 4)))
    with pytest.raises(Exception, match="down must be"):
        _run(_session(gate_up, down[:, :, :4].copy(), 2, True), np.zeros((3, 16)), np.zeros((3, 4)))
    with pytest.raises(Exception, match="top_k must be a positive integer"):
        _session(gate_up, down, 0, True)
