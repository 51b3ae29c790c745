"""octavo.BlockMatMul (plugins/onnxruntime/block_matmul_kernel.h) and its layout (octavo/export/block_layout.py).

References, independent of the code under test:
- `gguf.quants.dequantize` (the gguf package's decoder) on real GGML bytes: the layout's weights, bit for bit;
- numpy float64 x @ W^T for the op run by a real onnxruntime InferenceSession, within bounds derived from the
  kernel's arithmetic (`_int_bound`, `_float_bound`), not fitted to what it happens to return:
  - steps of <= 8 rows, and decode-only steps of any size (the graph's decode_step input), round x to int16 per
    block (scale = max|x| / 32767): per element |x - q s| <= (0.5 +
    32767 * 2u) / 32767 * max|x| + u * max|x| < 1.02 * 2^-16 * max_block|x| (u = 2^-24: the float32 products
    x * (32767 / max) and q * s), times |code * scale| (the integer-multiplied part of w = code * scale +
    offset; the offset meets float32 block sums of x, so |code * scale|, not |w|, bounds this term), plus float32
    rounding of the block sums, the per-block products and the accumulation over blocks;
  - other steps past 8 rows (a prompt's), and a step the 16-bit path refuses (a non-finite value, int32 sums that
    could overflow, a block longer than the kernel's chunk), are float32 FMAs over the file's float32 weights:
    |err| <= (K + 2) u * (sum_k |x||w| + |bias|);
  - on a CPU with AMX-BF16 (`AMX`), those steps take the float32-grade AMX path where blocks are a multiple of 32
    (`SPLIT`): x split into three bfloat16 pieces that sum to it exactly, times the codes (exact in bfloat16), so
    every product is exact; per block, 3 * block_size float32 additions, then scale * C + offset * (block sum of
    x, block_size additions) added into y, two roundings a block: |err| <= (3 bs + 2 nb + 10) u * 1.01 *
    sum_k |x| (|code * scale| + |offset|) + 2 u |bias| (`_split_bound`).
An int8 rounding of x (MatMulNBits' accuracy_level 4) would miss the first bound by ~2^8; a wrong code, scale
or panel index misses both by orders of magnitude.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_gguf_native import _raw_blocks, _reference

from octavo.export.block_layout import PANEL, PanelWeights, panel_weights
from octavo.export.gguf_blocks import NATIVE_TYPES, Blocks, parse_blocks, promote
from octavo.oplib_build import build_plans, plan_variant
from octavo.runtime.backends.op_variants import X86_64_V3, X86_64_V4, cpu_flags
from octavo.runtime.backends.oplib import library_path

U = 2.0 ** -24  # float32 unit roundoff
MAX_INT_ROWS = 8  # kIntRows in block_matmul_kernel.h: steps of up to 8 rows take the 16-bit path
INT_ROWS = (1, 2, 3, 4, 5, 7, 8)  # one pass of 4 rows over a panel, two passes, partial passes
# float32 tiles (or, decode steps, 16-bit 6-row tiles): partial (rows % 6 = 3, 1, 2, 4), several, many
FLOAT_ROWS = (9, 13, 14, 64, 300)
# K-quants need K a multiple of 256; the 32-blocks also run K = 96 and 544 (not multiples of 256) below
_K = {t: (256 if t.endswith("_K") else 96) for t in NATIVE_TYPES}


def _session(pw: PanelWeights, bias: np.ndarray | None = None, *, codes: np.ndarray | None = None,
             decode: bool | np.ndarray | None = None, library: Path | None = None,
             splits: list[int] | None = None, edit: Callable[[onnx.ModelProto], None] | None = None,
             **attrs: int) -> ort.InferenceSession:
    """One BlockMatMul node, as projection.py `_block_matmul` emits it; x [..., K] is the graph's input, DECODE (if
    given) the constant decode_step input (projection.py computes it per step; an array: that tensor as it is)."""
    codes = pw.codes if codes is None else codes
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(pw.scales, "scales"),
             numpy_helper.from_array(pw.offsets, "offsets")]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(np.float32), "bias"))
    attributes = {"K": pw.k, "N": pw.n, "bits": pw.bits, "block_size": pw.block_size, **attrs}
    names = ["x", "codes", "scales", "offsets"] + (["bias"] if bias is not None else [])
    if decode is not None or pw.scale_super is not None:
        names += [] if bias is not None else [""]
    if decode is not None:
        flag = decode if isinstance(decode, np.ndarray) else np.array([decode])
        inits.append(numpy_helper.from_array(flag, "decode_step"))
        names += ["decode_step"]
    if pw.scale_super is not None:  # two-level scales (K-quants): inputs 6 and 7
        inits += [numpy_helper.from_array(pw.scale_super, "scale_super"),
                  numpy_helper.from_array(pw.offset_super, "offset_super")]
        names += ([] if decode is not None else [""]) + ["scale_super", "offset_super"]
    outputs = ["y"] if splits is None else [f"y{i}" for i in range(len(splits))]
    if splits is not None:
        attributes["splits"] = splits
    node = helper.make_node("BlockMatMul", names, outputs, domain="octavo", **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("octavo", 1)])
    model.ir_version = 8
    if edit is not None:
        edit(model)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library or library_path()))
    options.intra_op_num_threads = 2  # the panels split over ParallelFor
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> tuple[Blocks, np.ndarray]:
    """(parsed blocks, gguf's float32 dequantization [n, k]) of a real GGML tensor."""
    raw = _raw_blocks(type_name, n, k, seed)
    blocks = parse_blocks(type_name, raw, n, k)
    assert blocks is not None
    return blocks, _reference(type_name, raw, n, k)


def _parts(blocks: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """float64 |code * scale| and |offset| per element [N, K], from the Blocks (not the panel layout)."""
    n, nb, bs = blocks.codes.shape
    scales = blocks.scales.astype(np.float64)[..., None]
    mins = 0.0 if blocks.mins is None else blocks.mins.astype(np.float64)[..., None]
    offsets = mins - blocks.zero.astype(np.float64)[..., None] * scales
    cs = np.abs(blocks.codes.astype(np.float64) * scales)
    return cs.reshape(n, -1), np.broadcast_to(np.abs(offsets), (n, nb, bs)).reshape(n, -1)


def _int_bound(x: np.ndarray, blocks: Blocks, bias: np.ndarray | None) -> np.ndarray:
    """|y - x @ W^T| bound [rows, N] on the 16-bit path (derivation in the module docstring)."""
    cs, off = _parts(blocks)
    bs, nb = blocks.block_size, blocks.k // blocks.block_size
    ax = np.abs(x.astype(np.float64))
    amax = np.repeat(ax.reshape(len(x), nb, bs).max(axis=2), bs, axis=1)  # [rows, K]: max |x| of each one's block
    rounding = 1.02 * 2.0 ** -16 * (amax @ cs.T)
    magnitude = (ax @ (cs + off).T) * (1 + 2.0 ** -15) + (0 if bias is None else np.abs(bias))
    return rounding + (nb + bs + 12) * U * magnitude


def _float_bound(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    k = w.shape[1]
    return (k + 2) * U * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
                          + (0 if bias is None else np.abs(bias)))


# The float32-grade AMX path of a prompt's steps (block_matmul_kernel.h): AVX-512 builds on AMX-BF16 CPUs
AMX = {"amx_bf16", "amx_tile", "avx512_bf16"} <= (cpu_flags() or frozenset())
# The bfloat16 path of prompt_bf16 nodes: AMX tiles, or without AMX the AVX512-BF16 vectors (amx.h); AVX-512 builds
BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= (cpu_flags() or frozenset())


def _split(blocks: Blocks) -> bool:
    """Whether the default node's prompt steps take the float32-grade AMX path here."""
    return AMX and blocks.block_size % 32 == 0


def _split_bound(x: np.ndarray, blocks: Blocks, bias: np.ndarray | None) -> np.ndarray:
    """|y - x @ W^T| bound [rows, N] on the float32-grade AMX path (derivation in the module docstring)."""
    cs, off = _parts(blocks)
    bs, nb = blocks.block_size, blocks.k // blocks.block_size
    magnitude = np.abs(x.astype(np.float64)) @ (cs + off).T
    return (3 * bs + 2 * nb + 10) * U * 1.01 * magnitude + 2 * U * (0 if bias is None else np.abs(bias))


def _want(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64).T + (0 if bias is None else bias.astype(np.float64))


def _check(session: ort.InferenceSession, x: np.ndarray, blocks: Blocks, w: np.ndarray,
           bias: np.ndarray | None = None, *, float32: bool | None = None) -> None:
    """The op's y within the bound of its path (FLOAT32: a prompt's path, float32 FMAs or, where `_split`, the
    float32-grade AMX path; default: a prompt's path past 8 rows)."""
    got = session.run(None, {"x": x})[0]
    assert got.shape == x.shape[:-1] + (w.shape[0],) and got.dtype == np.float32
    x2, got2 = x.reshape(-1, x.shape[-1]), got.reshape(-1, w.shape[0])
    rows = len(x2)
    float32 = rows > MAX_INT_ROWS if float32 is None else float32
    if not float32:
        bound = _int_bound(x2, blocks, bias)
    elif _split(blocks) and np.isfinite(x2).all():
        bound = _split_bound(x2, blocks, bias)
    else:
        bound = _float_bound(x2, w, bias)
    err = np.abs(got2 - _want(x2, w, bias))
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"rows={rows}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_layout_equals_gguf_dequantize_and_the_op_equals_x_w(type_name: str) -> None:
    n = 33  # two full panels and one of a single column
    k = _K[type_name]
    blocks, w = _blocks(type_name, n, k)
    pw = panel_weights(blocks)
    assert np.array_equal(pw.dequantize(), w)  # bit for bit
    assert pw.codes.shape == (3, k // 2, 32 * pw.bits // 8) and pw.scales.shape == (3, k // blocks.block_size, PANEL)
    rng = np.random.default_rng(1)
    for decode in (None, False, True):  # no decode_step input (an export from before it), a prompt's step, decode
        session = _session(pw, decode=decode)
        for rows in INT_ROWS + FLOAT_ROWS:
            _check(session, rng.standard_normal((rows, k)).astype(np.float32), blocks, w,
                   float32=rows > MAX_INT_ROWS and not decode)


def test_scale_dtype_is_float16_only_when_exact() -> None:
    """Q4_1's d and m are fp16 in the file: kept as fp16. Q4_K's d * 6-bit sub-scale needs up to 17 bits, so
    K-quants keep the file's two levels (int8 sub-scales of float32 super-block scales); a fused projection of a
    K-quant and a one-level type cannot, and stores float32."""
    q41 = panel_weights(_blocks("Q4_1", 17, 64)[0])
    q4k = panel_weights(_blocks("Q4_K", 17, 256)[0])
    q6k = panel_weights(_blocks("Q6_K", 17, 256)[0])
    assert q41.scales.dtype == q41.offsets.dtype == np.float16 and q41.scale_super is None
    assert q4k.scales.dtype == q4k.offsets.dtype == np.int8
    assert q4k.scale_super.shape == q4k.offset_super.shape == (2, 1, PANEL) and q4k.scale_super.dtype == np.float32
    assert q6k.block_size == 16 and q6k.bits == 8 and q6k.scales.dtype == np.int8
    mixed = panel_weights(promote([_blocks("Q4_K", 16, 256)[0], _blocks("Q8_0", 16, 256)[0]]))
    assert mixed.scales.dtype == np.float32 and mixed.scale_super is None


def _one_level(pw: PanelWeights) -> PanelWeights:
    """PW with its two-level scales multiplied out to float32 (the layout before two-level scales)."""
    scales, offsets = pw.float_scales
    return PanelWeights(pw.codes, scales.astype(np.float32), offsets.astype(np.float32), pw.bits, pw.block_size,
                        pw.k, pw.n)


def _mixed(n: int, k: int) -> Blocks:
    return promote([_blocks("Q4_K", n - n // 3, k, seed=21)[0], _blocks("Q6_K", n // 3, k, seed=22)[0]])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q4_K+Q6_K"])
@pytest.mark.parametrize("prompt_amx", [0, 1])
def test_two_level_scales_give_the_one_level_layouts_values(type_name: str, prompt_amx: int) -> None:
    """K-quants' two-level scales (int8 factor x float32 per 256 of K, formed in the kernel) give the outputs the
    float32 scales they multiply out to give, value for value, on every path: decode steps of 1-8 rows (the
    decode kernel), decode batches (6-row tiles over widened codes), prompt steps (float32 tiles, or where AMX
    runs the float32-grade split path), K over two chunks, a bias, a partial last panel."""
    n, k = 37, 1792
    blocks = _mixed(n, k) if "+" in type_name else _blocks(type_name, n, k, seed=23)[0]
    pw = panel_weights(blocks)
    assert pw.scales.dtype == np.int8 and pw.scale_super.shape == (3, k // 256, PANEL)
    bias = np.random.default_rng(24).standard_normal(n).astype(np.float32)
    x = np.random.default_rng(25).standard_normal((64, k)).astype(np.float32)
    x[:, 7] *= 40.0
    for decode in (False, True):
        two, one = (_session(p, bias, decode=decode, prompt_amx=prompt_amx) for p in (pw, _one_level(pw)))
        for rows in (1, 2, 5, 8, 9, 14, 64):
            np.testing.assert_array_equal(two.run(None, {"x": x[:rows]})[0], one.run(None, {"x": x[:rows]})[0],
                                          err_msg=f"{rows} rows, decode={decode}")


def test_two_level_scales_bad_shapes_are_errors_naming_the_input() -> None:
    pw = panel_weights(_blocks("Q4_K", 24, 512)[0])
    x = {"x": np.ones((1, 512), np.float32)}
    bad = PanelWeights(pw.codes, pw.scales, pw.offsets, pw.bits, pw.block_size, pw.k, pw.n,
                       pw.scale_super[:, :1].copy(), pw.offset_super[:, :1].copy())  # 1 super-block for nb = 16: G = 16
    assert np.array_equal(_session(bad).run(None, x)[0].shape, (1, 24))  # a valid power of two: runs
    odd = PanelWeights(pw.codes, pw.scales, pw.offsets, pw.bits, pw.block_size, pw.k, pw.n,
                       np.concatenate([pw.scale_super] * 3, axis=1), np.concatenate([pw.offset_super] * 3, axis=1))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"octavo\.BlockMatMul: scale_super and offset_super must be float32 \[2, nb / G, 16\] with G a "
                             r"power of two dividing nb = 16, got \[2, 6, 16\] and \[2, 6, 16\]"):
        _session(odd).run(None, x)
    floats = PanelWeights(pw.codes, pw.scales.astype(np.float32), pw.offsets.astype(np.float32), pw.bits,
                          pw.block_size, pw.k, pw.n, pw.scale_super, pw.offset_super)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"with scale_super, scales must be int8 \[2, 16, 16\]"):
        _session(floats).run(None, x)


@pytest.mark.parametrize("type_name,n,k", [("Q4_0", 17, 544), ("Q8_0", 17, 544), ("Q4_1", 1, 96),
                                           ("Q5_1", 16, 32), ("Q6_K", 17, 512), ("Q4_K", 31, 512)])
def test_shapes_and_bias(type_name: str, n: int, k: int) -> None:
    """N not a multiple of 16 (padded columns never written), K not a multiple of 256, block 16, a bias."""
    blocks, w = _blocks(type_name, n, k, seed=2)
    pw = panel_weights(blocks)
    assert np.array_equal(pw.dequantize(), w)
    rng = np.random.default_rng(3)
    bias = rng.standard_normal(n).astype(np.float32)
    for decode in (False, True):
        session = _session(pw, bias, decode=decode)
        for rows in (1, 3, 8, 9, 13):
            _check(session, rng.standard_normal((rows, k)).astype(np.float32), blocks, w, bias,
                   float32=rows > MAX_INT_ROWS and not decode)


@pytest.mark.parametrize("type_name,k", [("Q4_1", 3104), ("Q8_0", 3104), ("Q6_K", 3328)])
def test_steps_past_one_widened_chunk(type_name: str, k: int) -> None:
    """K longer than the kernel's chunk (1536 k): past 8 rows a decode step's codes are widened a chunk at a
    time (Q4_1 and Q8_0: 97 blocks of 32 in chunks of 33, 33 and 31 blocks; Q6_K: 208 blocks of 16 in 70, 70
    and 68), each tile picking up the sums of the chunks before it."""
    blocks, w = _blocks(type_name, 21, k, seed=11)
    rng = np.random.default_rng(12)
    bias = rng.standard_normal(21).astype(np.float32)
    session = _session(panel_weights(blocks), bias, decode=True)
    for rows in (5, 9, 31):
        _check(session, rng.standard_normal((rows, k)).astype(np.float32), blocks, w, bias)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_a_long_prompt_step_runs_in_row_blocks_without_changing_a_bit(type_name: str) -> None:
    """A prompt's step of 301 rows x K = 3104 (float32, three chunks of 1036 k): the op hands its threads row
    blocks of at most 1 MiB of a chunk's x (<= 168 rows here), so this step is two or more blocks on any
    machine. Within the float32 bound, and each row the same bits as in shorter steps whose blocks split it
    elsewhere: every output still sums over k in order, one FMA per k."""
    blocks, w = _blocks(type_name, 37, 3104, seed=15)
    rng = np.random.default_rng(16)
    bias = rng.standard_normal(37).astype(np.float32)
    session = _session(panel_weights(blocks), bias, decode=False)
    x = rng.standard_normal((301, 3104)).astype(np.float32)
    _check(session, x, blocks, w, bias)
    together = session.run(None, {"x": x})[0]
    for lo, hi in ((0, 9), (150, 301), (97, 263)):
        np.testing.assert_array_equal(session.run(None, {"x": x[lo:hi]})[0], together[lo:hi])


@pytest.mark.parametrize("type_name,k", [("Q4_1", 576), ("Q8_0", 576), ("Q4_K", 512), ("Q6_K", 256)])
def test_a_decode_batch_gives_each_row_the_bits_it_gets_alone(type_name: str, k: int) -> None:
    """A decode step's rows (the 6-row tiles over widened codes) equal the same rows run one at a time (the
    decode kernel): the same int32 sums, scaled and summed in the same order, so a sequence's logits do not
    depend on how many others share its decode step."""
    blocks, _ = _blocks(type_name, 37, k, seed=13)
    rng = np.random.default_rng(14)
    bias = rng.standard_normal(37).astype(np.float32)
    session = _session(panel_weights(blocks), bias, decode=True)
    x = rng.standard_normal((45, k)).astype(np.float32)
    x[:, 5] *= 50.0  # an outlier channel, as real activations have
    together = session.run(None, {"x": x})[0]
    alone = np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])
    np.testing.assert_array_equal(together, alone)


def test_decode_step_must_be_one_bool() -> None:
    """A decode_step of another type fails when the session is made; of another shape, when the step runs."""
    pw = panel_weights(_blocks("Q4_0", 24, 96)[0])
    with pytest.raises(Exception, match=r"(?i)type"):
        _session(pw, decode=np.array([1], np.int32))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"octavo\.BlockMatMul: decode_step must be bool \[1\], got \[2\]"):
        _session(pw, decode=np.array([True, True])).run(None, {"x": np.ones((9, 96), np.float32)})


def test_promoted_mixed_types() -> None:
    """A fused projection of Q4_K (4-bit, block 32, mins) and Q6_K (6-bit, block 16, zero point 32) parts."""
    k = 256
    (a, wa), (b, wb) = _blocks("Q4_K", 20, k, seed=4), _blocks("Q6_K", 13, k, seed=5)
    blocks = promote([a, b])
    w = np.concatenate([wa, wb])
    pw = panel_weights(blocks)
    assert (pw.bits, pw.block_size, pw.n) == (8, 16, 33)
    assert np.array_equal(pw.dequantize(), w)
    session = _session(pw)
    rng = np.random.default_rng(6)
    for rows in (1, 2, 3, 8, 9):
        _check(session, rng.standard_normal((rows, k)).astype(np.float32), blocks, w)


def test_zero_rows_and_a_3d_input() -> None:
    blocks, w = _blocks("Q4_0", 24, 64)
    session = _session(panel_weights(blocks))
    assert session.run(None, {"x": np.zeros((0, 64), np.float32)})[0].shape == (0, 24)
    assert session.run(None, {"x": np.zeros((2, 0, 64), np.float32)})[0].shape == (2, 0, 24)
    rng = np.random.default_rng(7)
    for t in (1, 4, 5):  # [2, 1, K], [2, 4, K]: 2 and 8 rows, the 16-bit path; [2, 5, K]: 10 rows, float32
        _check(session, rng.standard_normal((2, t, 64)).astype(np.float32), blocks, w)


def test_tiny_and_large_activations_keep_their_relative_precision() -> None:
    """The 16-bit scale is per block: blocks of ~1e-36 (32767 / max overflows float32; found by this test: such a
    block came back 300% off, now the kernel takes the float32 path below 2^-64) or ~1e30 next to ordinary ones
    are still within the bound of their own block."""
    blocks, w = _blocks("Q8_0", 16, 128)
    session = _session(panel_weights(blocks))
    rng = np.random.default_rng(8)
    for magnitude in (1e-36, 1e-30, 1e-19, 1e-10, 1e20, 1e30):
        x = rng.standard_normal((2, 128)).astype(np.float32)
        x[:, :32] *= np.float32(magnitude)  # one block of each row
        x[0, 3] = 0.0  # a zero next to the tiny or huge values
        _check(session, x, blocks, w)
        alone = x.copy()
        alone[:, 32:] = 0.0  # only that block: its error must be relative to its own size
        _check(session, alone, blocks, w)


@pytest.mark.parametrize("bits,block_size", [(8, 256), (8, 512), (4, 2048)])
def test_large_blocks_do_not_overflow_the_integer_sums(bits: int, block_size: int) -> None:
    """A block's int32 sum of 32767 * 255 per element overflows past 257 values of 8-bit codes (found by this
    test: block 512 gave -2064 for 522240); GGUF blocks are 16 or 32, but the op takes any block size. Such
    blocks take the float32 path, as does a block longer than the kernel's widened chunk (1536) past 8 rows."""
    n, k = 16, 2048
    nb = k // block_size
    codes = np.full((n, nb, block_size), 2 ** bits - 1, np.uint8)
    codes[1] = np.random.default_rng(10).integers(0, 2 ** bits, (nb, block_size))
    blocks = Blocks(codes, np.full((n, nb), 0.5, np.float32), np.zeros((n, nb), np.uint8), None, bits, ("test",))
    session = _session(panel_weights(blocks), decode=True)
    overflows = 32767 * (2 ** bits - 1) * block_size > 2 ** 31 - 1
    for rows in (1, 8, 9, 13):
        float32 = overflows or (rows > 8 and block_size > 1536)
        _check(session, np.ones((rows, k), np.float32), blocks, blocks.dequantize(), float32=float32)


@pytest.mark.parametrize("rows,first", [(1, 0), (3, 0), (8, 0), (9, 0), (40, 35)])
def test_non_finite_activations_propagate_like_float32(rows: int, first: int) -> None:
    """inf in x gives +-inf where w != 0 and nan where w == 0 (inf * 0), nan gives nan: as IEEE float32 (the
    16-bit path refuses the step, which goes float32). Row FIRST holds the inf: 35 of 40 is in the second range
    of rows the op rounds to 16 bits on its own thread; the whole step must still refuse."""
    blocks, w = _blocks("Q4_0", 40, 64)  # Q4_0 code 8 dequantizes to exactly 0
    session = _session(panel_weights(blocks), decode=True)  # past 8 rows too, the 16-bit path would take it
    rng = np.random.default_rng(9)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    k_inf = int(np.argmax((w == 0).sum(axis=0)))  # a column of W with zeros
    assert (w[:, k_inf] == 0).any() and (w[:, k_inf] != 0).any()
    x[first, k_inf] = np.inf
    if rows > 1:
        x[first + 1, 7] = np.nan
    got = session.run(None, {"x": x})[0]
    with np.errstate(invalid="ignore", over="ignore"):
        want = (x.astype(np.float64)[:, None, :] * w.astype(np.float64)[None]).sum(axis=2)
    assert np.isnan(want[first]).any() and np.isinf(want[first]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want).all(axis=1)  # the finite rows still get their float32 product
    if finite.any():
        bound = _float_bound(x[finite], w, None)
        assert (np.abs(got[finite] - want[finite]) <= bound).all()


def test_wrong_codes_shape_is_an_error_naming_the_op_and_the_shape() -> None:
    pw = panel_weights(_blocks("Q4_0", 24, 96)[0])
    session = _session(pw, codes=pw.codes[:, :-1])
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"octavo\.BlockMatMul: codes must be uint8 \[2, 48, 16\], got \[2, 47, 16\]"):
        session.run(None, {"x": np.ones((1, 96), np.float32)})
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"octavo\.BlockMatMul: x \[1, 95\]"):
        _session(pw).run(None, {"x": np.ones((1, 95), np.float32)})


@pytest.mark.parametrize("attrs,message", [({"bits": 5}, r"bits must be 4 or 8, got 5"),
                                           ({"block_size": 6}, r"block_size \(6\) must be a multiple of 4"),
                                           ({"block_size": 64}, r"block_size \(64\) .*divides K \(96\)")])
def test_bad_attributes_fail_at_session_creation(attrs: dict[str, int], message: str) -> None:
    pw = panel_weights(_blocks("Q4_0", 24, 96)[0])
    with pytest.raises(Exception, match=r"octavo\.BlockMatMul: " + message):
        _session(pw, **attrs)


@pytest.fixture(scope="module")
def portable_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The x86-64-v3 build (256-bit tiles) and, on a CPU that runs it, the x86-64-v4 build (AVX-512 tiles
    without VNNI): beside the native build (AVX-512 + VNNI on such a CPU) each path has a build of its own."""
    flags = cpu_flags() or frozenset()
    variants = [v for v in (X86_64_V3, X86_64_V4) if not v.missing(flags)]
    if not variants:
        pytest.skip("this CPU runs neither x86-64 portable build")
    folder = tmp_path_factory.mktemp("variants")
    paths = build_plans([plan_variant(v, folder, fetch=False) for v in variants])
    return {v.name: path for v, path in zip(variants, paths)}


@pytest.mark.parametrize("type_name,n,k", [("Q4_1", 149, 576), ("Q8_0", 149, 1792), ("Q6_K", 37, 1792),
                                           ("Q4_K", 70, 512)])
def test_every_build_gives_the_same_bits(portable_builds: dict[str, Path], type_name: str, n: int, k: int) -> None:
    """The 256-bit tiles, the AVX-512 tiles (with and without VNNI) and the decode kernel's builds compute every
    output in the same order: the same bits on every path (prompt and decode steps, 1-301 rows, groups of 1-4
    panels with a partial last panel, K in one chunk and in two, blocks of 16 and 32, a bias)."""
    blocks, _ = _blocks(type_name, n, k, seed=5)
    pw = panel_weights(blocks)
    bias = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    libraries = {"native": library_path(), **portable_builds}
    x = np.random.default_rng(7).standard_normal((301, k)).astype(np.float32)
    # prompt_bf16 = 1 and prompt_amx = 1 (the default): the AMX paths of the AVX-512 builds; prompt_amx = 0: the
    # float32 FMA tiles on every build
    for decode, bf16, amx in ((False, 0, 0), (True, 0, 0), (False, 1, 0), (False, 0, 1)):
        outputs = {}
        for name, library in libraries.items():
            if (bf16 or amx) and name == X86_64_V3.name:
                continue  # no AMX path in the 256-bit build (amx.h): there those nodes take the FMA tiles
            session = _session(pw, bias, decode=decode, library=library, prompt_amx=amx,
                               **({"prompt_bf16": 1} if bf16 else {}))
            outputs[name] = [session.run(None, {"x": x[:rows]})[0] for rows in (1, 5, 8, 9, 46, 64, 301)]
        for name, got in outputs.items():
            for want, have in zip(outputs["native"], got):
                np.testing.assert_array_equal(have, want, err_msg=f"{name} build, {len(want)} rows, decode={decode}, "
                                                                  f"prompt_bf16={bf16}, prompt_amx={amx}")


@pytest.mark.parametrize("type_name,n,k,splits", [("Q4_1", 149, 576, [48, 64, 37]), ("Q8_0", 96, 1792, [32, 64]),
                                                  ("Q6_K", 37, 256, [16, 16, 5]), ("Q4_K", 64, 512, [16, 16, 16, 16])])
def test_split_outputs_are_the_columns_of_the_single_output(type_name: str, n: int, k: int, splits: list[int]) -> None:
    """With `splits`, the op writes y's column ranges as separate outputs (the graph's q/k/v and gate/up): each the
    same bits as those columns of the one-output op, on every path (decode and prompt steps, groups of panels that
    span two parts, a partial last panel)."""
    blocks, _ = _blocks(type_name, n, k, seed=8)
    pw = panel_weights(blocks)
    bias = np.random.default_rng(9).standard_normal(n).astype(np.float32)
    x = np.random.default_rng(10).standard_normal((301, k)).astype(np.float32)
    edges = np.cumsum([0, *splits])
    for decode in (False, True):
        whole, parts = _session(pw, bias, decode=decode), _session(pw, bias, decode=decode, splits=splits)
        for rows in (1, 5, 9, 46, 301):
            want = whole.run(None, {"x": x[:rows]})[0]
            got = parts.run(None, {"x": x[:rows]})
            assert [g.shape for g in got] == [(rows, size) for size in splits]
            for i, part in enumerate(got):
                np.testing.assert_array_equal(part, want[:, edges[i]:edges[i + 1]], err_msg=f"part {i}, {rows} rows")


@pytest.mark.parametrize("splits,message", [([48, 64, 36], r"must sum to N = 149"),
                                            ([40, 109], r"all but the last a multiple of 16"),
                                            ([16, 16, 16, 16, 85], r"output size 5 not in range")])
def test_bad_splits_fail_at_session_creation(splits: list[int], message: str) -> None:
    blocks, _ = _blocks("Q4_1", 149, 96)
    with pytest.raises(Exception, match=message):
        _session(panel_weights(blocks), splits=splits)


def test_splits_must_match_the_nodes_outputs() -> None:
    def one_output(model: onnx.ModelProto) -> None:
        del model.graph.node[0].output[1]
        del model.graph.output[1]

    blocks, _ = _blocks("Q4_1", 149, 96)
    with pytest.raises(Exception, match=r"the node has 1 outputs; splits \[48, 101\] needs 2"):
        _session(panel_weights(blocks), splits=[48, 101], edit=one_output)


# prompt_bf16 = 1 (the block-bf16 kernel's nodes): on a CPU with AVX512-BF16 (AMX tiles where AMX-BF16 runs,
# VDPBF16PS vectors elsewhere) a prompt's steps round x and the file's weights to bfloat16 (nearest even) and sum
# their products in float32, so the reference is float64 bf16(x) @ bf16(W)^T within the float32 path's bound over
# those values; decode steps are unchanged. Without AVX512-BF16 the node is the float32 node bit for bit.


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32, for finite values."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("type_name,n,k", [("Q4_1", 149, 576), ("Q8_0", 96, 1792), ("Q4_K", 70, 512),
                                           ("Q6_K", 37, 256), ("Q5_0", 40, 96)])
def test_prompt_bf16_steps_are_bf16_products_summed_in_float32(type_name: str, n: int, k: int) -> None:
    blocks, w = _blocks(type_name, n, k, seed=11)
    pw = panel_weights(blocks)
    bias = np.random.default_rng(12).standard_normal(n).astype(np.float32)
    bf16, plain = _session(pw, bias, prompt_bf16=1), _session(pw, bias)
    x = np.random.default_rng(13).standard_normal((300, k)).astype(np.float32)
    for rows in (9, 16, 17, 33, 300):  # one partial row tile, whole tiles, 32-row pairs and a partial last one
        got, float32 = bf16.run(None, {"x": x[:rows]})[0], plain.run(None, {"x": x[:rows]})[0]
        if not BF16:
            np.testing.assert_array_equal(got, float32)
            continue
        xb, wb = _bf16(x[:rows]), _bf16(w)
        err, bound = np.abs(got - _want(xb, wb, bias)), _float_bound(xb, wb, bias)
        assert (err <= bound).all(), f"rows={rows}: worst error / bound {(err / bound).max():.3g}"
        exact = _want(x[:rows], w, bias)  # it did round to bfloat16: 10x further from float64 than float32 is
        assert np.abs(got - exact).max() > 10 * np.abs(float32 - exact).max()
        np.testing.assert_array_equal(got, bf16.run(None, {"x": x[:300]})[0][:rows])  # rows do not change bits
    for decode in (False, True):  # 16-bit steps: unchanged
        rows = 8 if not decode else 46
        a, b = _session(pw, bias, decode=decode, prompt_bf16=1), _session(pw, bias, decode=decode)
        np.testing.assert_array_equal(a.run(None, {"x": x[:rows]})[0], b.run(None, {"x": x[:rows]})[0])


def test_prompt_bf16_must_be_0_or_1() -> None:
    pw = panel_weights(_blocks("Q4_0", 24, 96)[0])
    with pytest.raises(Exception, match=r"octavo\.BlockMatMul: prompt_bf16 must be 0 or 1, got 2"):
        _session(pw, prompt_bf16=2)


# prompt_amx = 1 (every node's default): on a CPU with AMX-BF16, a prompt's steps (the float32 path's) over blocks
# of a multiple of 32 take the float32-grade AMX path. The reference is float64 x @ W^T within `_split_bound`;
# the path must really run (other bits than the FMA tiles', prompt_amx = 0), be at least as close to float64 as
# the FMA tiles past one block, and give a row the same bits whatever else is in its step.
@pytest.mark.parametrize("type_name,n,k", [("Q4_1", 149, 576), ("Q4_0", 64, 576), ("Q8_0", 96, 1792),
                                           ("Q4_K", 70, 512), ("Q5_K", 33, 256), ("Q5_1", 40, 96),
                                           ("Q6_K", 37, 256), ("Q4_0", 20, 32), ("Q8_0", 17, 32)])
def test_prompt_steps_on_amx_are_exact_products_summed_in_float32(type_name: str, n: int, k: int) -> None:
    blocks, w = _blocks(type_name, n, k, seed=17)
    pw = panel_weights(blocks)
    bias = np.random.default_rng(18).standard_normal(n).astype(np.float32)
    amx, fma = _session(pw, bias), _session(pw, bias, prompt_amx=0)
    x = np.random.default_rng(19).standard_normal((301, k)).astype(np.float32)
    x[:, 7] *= 40.0  # an outlier channel, as real activations have
    whole = amx.run(None, {"x": x})[0]
    for rows in (9, 16, 17, 33, 64, 301):  # partial row tiles, one, a 32-row pair and one more, many tasks
        got, plain = amx.run(None, {"x": x[:rows]})[0], fma.run(None, {"x": x[:rows]})[0]
        if not _split(blocks):  # no AMX here, or Q6_K's blocks of 16: the FMA tiles
            np.testing.assert_array_equal(got, plain)
            continue
        want = _want(x[:rows], w, bias)
        err, bound = np.abs(got - want), _split_bound(x[:rows], blocks, bias)
        assert (err <= bound).all(), f"rows={rows}: worst error / bound {(err / bound).max():.3g}"
        assert not np.array_equal(got, plain)  # the AMX path ran
        # and at least as close to float64 as float32 FMAs (2-8x closer on these; dropping the third piece makes
        # it ~10x further), except at a single block with a per-block min (Q4_1, K-quants): there its
        # scale * C + min * sum may cancel, within its bound (zero points move into the codes: no such term)
        if k > blocks.block_size or blocks.mins is None:
            assert err.max() <= np.abs(plain - want).max()
        np.testing.assert_array_equal(got, whole[:rows])  # rows do not change bits
    for decode in (False, True):  # 16-bit steps: unchanged
        rows = 8 if not decode else 46
        a, b = _session(pw, bias, decode=decode), _session(pw, bias, decode=decode, prompt_amx=0)
        np.testing.assert_array_equal(a.run(None, {"x": x[:rows]})[0], b.run(None, {"x": x[:rows]})[0])
    # a decode batch (AMX-INT8 on such a CPU, one block a row at K = 32 too) gives each row its bits alone (the
    # one-row 16-bit kernel)
    decode = _session(pw, bias, decode=True)
    alone = np.concatenate([decode.run(None, {"x": x[i:i + 1]})[0] for i in range(46)])
    np.testing.assert_array_equal(decode.run(None, {"x": x[:46]})[0], alone)


@pytest.mark.parametrize("value", [np.inf, np.nan, 2.0 ** 101, 2.0 ** -101])
def test_prompt_steps_the_amx_path_refuses_take_the_fma_tiles(value: float) -> None:
    """A non-finite x, |x| >= 2^100 (products with the codes near float32's top) or a nonzero |x| < 2^-100 (its
    last bfloat16 piece would be subnormal, which AMX reads as 0): the whole step takes the FMA tiles, the same
    bits as prompt_amx = 0."""
    blocks, _ = _blocks("Q4_1", 40, 96)
    pw = panel_weights(blocks)
    x = np.random.default_rng(20).standard_normal((40, 96)).astype(np.float32)
    x[37, 11] = value  # in the second range of rows the op splits on its own thread
    with np.errstate(invalid="ignore", over="ignore"):
        got = _session(pw).run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, _session(pw, prompt_amx=0).run(None, {"x": x})[0])


def test_prompt_amx_must_be_0_or_1() -> None:
    pw = panel_weights(_blocks("Q4_0", 24, 96)[0])
    with pytest.raises(Exception, match=r"octavo\.BlockMatMul: prompt_amx must be 0 or 1, got 3"):
        _session(pw, prompt_amx=3)


_AMX_OFF_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_block_matmul import _blocks, _session
from octavo.export.block_layout import panel_weights
from octavo.runtime.backends.oplib import set_amx
assert set_amx(False)  # on until told: the library reads no environment
blocks, _ = _blocks("Q4_1", 149, 576, seed=21)
pw = panel_weights(blocks)
x = np.random.default_rng(22).standard_normal((64, 576)).astype(np.float32)
np.savez(sys.argv[2], prompt=_session(pw).run(None, {"x": x})[0],
         bf16=_session(pw, prompt_bf16=1).run(None, {"x": x})[0],
         decode=_session(pw, decode=True).run(None, {"x": x[:46]})[0])
"""


def test_amx_switched_off_turns_every_amx_path_off(tmp_path: Path) -> None:
    """The library's AMX switch off (oplib.set_amx(False), what EngineArgs.amx=False / OCTAVO_AMX=0 do; one per
    process, so in a process of its own): a prompt step of the default node is the FMA tiles' bits (prompt_amx
    = 0), a decode batch the 16-bit tiles' (the same bits either way), and a prompt_bf16 node's prompt step what a
    CPU without AMX computes: the AVX512-BF16 vectors' bfloat16 products where the CPU has them, else the FMA
    tiles'."""
    import os
    import subprocess
    import sys

    out = tmp_path / "off.npz"
    env = {k: v for k, v in os.environ.items() if k != "OCTAVO_AMX"}  # the switch alone turns AMX off
    subprocess.run([sys.executable, "-c", _AMX_OFF_SCRIPT, str(Path(__file__).parent), str(out)], check=True,
                   env=env, timeout=300)
    got = np.load(out)
    blocks, _ = _blocks("Q4_1", 149, 576, seed=21)
    pw = panel_weights(blocks)
    x = np.random.default_rng(22).standard_normal((64, 576)).astype(np.float32)
    fma = _session(pw, prompt_amx=0).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got["prompt"], fma)
    if BF16:
        xb, wb = _bf16(x), _bf16(pw.dequantize()[:149])
        err, bound = np.abs(got["bf16"] - _want(xb, wb, None)), _float_bound(xb, wb, None)
        assert (err <= bound).all() and not np.array_equal(got["bf16"], fma)
        if not AMX:  # the same path in this process
            np.testing.assert_array_equal(got["bf16"], _session(pw, prompt_bf16=1).run(None, {"x": x})[0])
    else:
        np.testing.assert_array_equal(got["bf16"], fma)
    np.testing.assert_array_equal(got["decode"], _session(pw, decode=True).run(None, {"x": x[:46]})[0])
