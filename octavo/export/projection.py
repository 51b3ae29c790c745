"""Linear layers as ONNX nodes: x @ W^T (+ bias) over a checkpoint's weights, as a float32 Gemm, octavo.BlockMatMul
over quantized blocks (a GGUF's own, or octavo's int8/int4; the default kernel) or ONNX Runtime's MatMulNBits
(with a GGUF's mins term and its int8 residual correction). Several projections of one input (q/k/v, gate/up) are
written as one weight, the result split per part.
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from octavo.export.block_layout import PANEL, PanelWeights, panel_weights
from octavo.export.gguf_blocks import Blocks, promote
from octavo.export.graph_builder import OP_DOMAIN, CheckpointTensors, Graph, Part, emit
from octavo.export.quantize import MS_DOMAIN, BlockQuantized, QuantConfig, concat, quantize, unpacked

Bias = tuple[str, list[np.ndarray]]  # (initializer name, parts stacked along N)


def project(g: Graph, w: CheckpointTensors, x: str, name: str, parts: list[Part], bias: Bias | None,
            quant: QuantConfig | None, output: str | None = None) -> str:
    """x @ W^T (+ bias), W = the PARTS stacked along N: Gemm(transB) over the float32 weight; with an
    int8/int4 QUANT, our blockwise quantization of it; with the "gguf" QUANT, the file's own blocks (exact;
    a float Gemm where a part's type has no exact layout). Quantized weights go through octavo.BlockMatMul
    (quant.kernel "block", the default) or MatMulNBits ("matmulnbits"). OUTPUT names the result."""
    return project_parts(g, w, x, name, parts, bias, quant, None, output)[0]


MAX_BLOCK_OUTPUTS = 4  # octavo::Outputs::kMax (plugins/onnxruntime/block_matmul_kernel.h)


def project_parts(g: Graph, w: CheckpointTensors, x: str, name: str, parts: list[Part], bias: Bias | None,
                  quant: QuantConfig | None, split: tuple[str, list[int]] | None,
                  output: str | None = None) -> list[str]:
    """project, and with SPLIT = (the name of a shared constant, sizes) its result split along N into those
    sizes. A BlockMatMul writes the parts itself where every split point is a panel boundary (SmolLM2's q/k/v
    and gate/up: a Split was 3-5 % of every step); any other projection is followed by a Split."""
    def then_split(y: str) -> list[str]:
        if split is None:
            return [y]
        sizes = g.shared_const(split[0], np.array(split[1], np.int64))
        return g.op("Split", [y, sizes], num_outputs=len(split[1]), axis=1)

    def block_matmul(blocks: Blocks) -> list[str]:
        if split is not None and len(split[1]) <= MAX_BLOCK_OUTPUTS and all(s % PANEL == 0 for s in split[1][:-1]):
            return _block_matmul(g, x, name, blocks, bias, None, splits=split[1], bf16=quant.prompt_bf16)
        return then_split(_block_matmul(g, x, name, blocks, bias, output, bf16=quant.prompt_bf16)[0])

    per_part = w.part_blocks(parts) if quant is not None and quant.native else None
    if per_part is not None and quant.block_kernel and split is not None:
        runs = _layout_runs(per_part, split[1])
        if runs is not None:  # parts of different layouts (Q4_K_M's Q4_K q/k beside a Q6_K v): one node each run
            outs: list[str] = []
            for i, (lo, hi) in enumerate(runs):
                run_bias = (f"{bias[0]}.{i}", bias[1][lo:hi]) if bias else None
                outs += _block_matmul(g, x, f"{name}.{i}", promote(per_part[lo:hi]), run_bias, None,
                                      splits=split[1][lo:hi], bf16=quant.prompt_bf16)
            return outs
    blocks = None if per_part is None else promote(per_part)
    if blocks is not None:
        if quant.block_kernel:
            return block_matmul(blocks)
        return then_split(project_blocks(g, x, name, blocks, bias, quant, output))
    floats = [w.get(part, shape) for part, shape in parts]
    if quant is None or not quant.enabled or quant.native:
        inputs = [x, g.weight(name, floats)] + ([g.weight(*bias)] if bias else [])
        return then_split(emit(g, "Gemm", inputs, output, transB=1))
    q = concat([quantize(p, quant.bits or 0, quant.block_size) for p in floats])
    if quant.block_kernel and q.k % q.block_size == 0:  # BlockMatMul has no partial last block
        codes, zero = unpacked(q)
        return block_matmul(Blocks(codes, q.scales, zero, None, q.bits, (quant.weights,)))
    return then_split(_matmulnbits(g, x, name, q, bias, quant.accuracy_level, output))


def _matmulnbits(g: Graph, x: str, name: str, q: BlockQuantized, bias: Bias | None, accuracy_level: int,
                 output: str | None) -> str:
    inputs = [x, g.weight(name + ".qweight", [q.packed], "u1"), g.weight(name + ".scales", [q.scales]),
              g.weight(name + ".zero_points", [q.zero_points], "u1")]
    inputs += ["", g.weight(*bias)] if bias else []  # input 4 (g_idx) unused; 5 is the bias
    return emit(g, "MatMulNBits", inputs, output, domain=MS_DOMAIN, K=q.k, N=q.n, bits=q.bits,
                 block_size=q.block_size, accuracy_level=accuracy_level)


def _layout_runs(parts: list[Blocks], sizes: list[int]) -> list[tuple[int, int]] | None:
    """The runs [lo, hi) of consecutive PARTS that share one block layout (bits, block size), where there are
    several and each can be one BlockMatMul writing its parts (SIZES: every part but a run's last a multiple of
    the panel); None where the parts share one layout, or the runs cannot be written so (promote them instead:
    exact too, but the narrower parts then take the widest codes and the smallest blocks)."""
    if len(parts) != len(sizes) or any(p.n != size for p, size in zip(parts, sizes)):
        return None
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(parts):
        if runs and (p.bits, p.block_size) == (parts[runs[-1][0]].bits, parts[runs[-1][0]].block_size):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    if len(runs) == 1:
        return None
    if any(hi - lo > MAX_BLOCK_OUTPUTS or any(s % PANEL for s in sizes[lo:hi - 1]) for lo, hi in runs):
        return None
    return runs


def project_blocks(g: Graph, x: str, name: str, blocks: Blocks, bias: Bias | None, quant: QuantConfig,
                   output: str | None) -> str:
    """MatMulNBits over the file's (codes - zero) * scale; a type with per-block mins (Q4_1, Q5_1,
    K-quants) adds sum_b blocksum(x)[b] * min[n, b] ([T, K/bs] block sums @ mins^T [K/bs, N]). With
    accuracy_level 4 and quant.residual_rows, x's int8 rounding is undone by octavo.Int8Residual /
    FoldRows (plugins/onnxruntime/int8_residual_op.cc): the weights are read once for x and its residual."""
    if quant.block_kernel:
        return _block_matmul(g, x, name, blocks, bias, output, bf16=quant.prompt_bf16)[0]
    q = blocks.matmulnbits()
    if not quant.residual:
        if blocks.mins is None:
            return _matmulnbits(g, x, name, q, bias, quant.accuracy_level, output)
        return emit(g, "Add", [_matmulnbits(g, x, name, q, bias, quant.accuracy_level, None),
                                _mins_term(g, name, blocks, _block_sums(g, x, q))], output)
    outs = g.op("Int8Residual", [x], num_outputs=2 if blocks.mins is not None else 1, domain=OP_DOMAIN,
                block_size=q.block_size, max_rows=quant.residual_rows)
    x2, sums = outs[0], outs[-1]
    y2 = _matmulnbits(g, x2, name, q, None, quant.accuracy_level, None)
    fold = [y2, x] + ([_mins_term(g, name, blocks, sums)] if blocks.mins is not None else [])
    if bias is None:
        return emit(g, "FoldRows", fold, output, domain=OP_DOMAIN)
    return emit(g, "Add", [g.op1("FoldRows", fold, domain=OP_DOMAIN), g.weight(*bias)], output)


DECODE_STEP = "decode_step"  # bool [1]: num_tokens == batch, every sequence of the step has one query token


def decode_step(g: Graph) -> str:
    """DECODE_STEP, computed once from the shapes of input_ids and past_seqlens and shared by every BlockMatMul:
    a decode-only step takes the op's 16-bit path at any batch size, any other step past 8 rows its float32 one
    (a prompt's logits stay float32 over the file's values)."""
    if g.first_use(DECODE_STEP):
        tokens, batch = g.op1("Shape", ["input_ids"]), g.op1("Shape", ["past_seqlens"])
        g.nodes.append(helper.make_node("Equal", [tokens, batch], [DECODE_STEP], name=DECODE_STEP))
    return DECODE_STEP


def _block_matmul(g: Graph, x: str, name: str, blocks: Blocks, bias: Bias | None, output: str | None,
                  splits: list[int] | None = None, *, bf16: bool = False) -> list[str]:
    """octavo.BlockMatMul over BLOCKS (a GGUF's own, or octavo's int8/int4 quantization; layout:
    octavo.export.block_layout): its one output (named OUTPUT), or with SPLITS one output per part. BF16 (the
    block-bf16 kernel): the attribute prompt_bf16 = 1 (absent otherwise: block exports are unchanged)."""
    pw = panel_weights(blocks)
    codes, supers = _panel_inputs(g, name, pw)
    inputs = [x, *codes, g.weight(*bias) if bias else "", decode_step(g), *supers]
    extra: dict[str, int] = {"prompt_bf16": 1} if bf16 else {}
    if splits is not None:
        return g.op("BlockMatMul", inputs, num_outputs=len(splits), domain=OP_DOMAIN, K=pw.k, N=pw.n, bits=pw.bits,
                    block_size=pw.block_size, splits=splits, **extra)
    return [emit(g, "BlockMatMul", inputs, output, domain=OP_DOMAIN, K=pw.k, N=pw.n, bits=pw.bits,
                  block_size=pw.block_size, **extra)]


def _panel_inputs(g: Graph, name: str, pw: PanelWeights) -> tuple[list[str], list[str]]:
    """([codes, scales, offsets], [scale_super, offset_super] or []) of PW as initializers NAME.*; written once
    per NAME (a tied model's embedding blocks serve BlockGather and the lm_head's BlockMatMul)."""
    scale_type = {np.dtype(np.float16): "f2", np.dtype(np.float32): "f4", np.dtype(np.int8): "i1"}[pw.scales.dtype]
    codes = [g.weight_once(name + ".codes", [pw.codes], "u1"), g.weight_once(name + ".scales", [pw.scales], scale_type),
             g.weight_once(name + ".offsets", [pw.offsets], scale_type)]
    if pw.scale_super is None:
        return codes, []
    # two-level scales (K-quants): int8 scales and offsets times these float32
    return codes, [g.weight_once(name + ".scale_super", [pw.scale_super]),
                   g.weight_once(name + ".offset_super", [pw.offset_super])]


def block_gather(g: Graph, ids: str, name: str, blocks: Blocks) -> str:
    """octavo.BlockGather: the rows IDS of BLOCKS ([N, K], a GGUF's token embedding in the file's own blocks),
    float32 (plugins/onnxruntime/block_gather_op.cc); the initializers are NAME.codes etc., BlockMatMul's layout."""
    pw = panel_weights(blocks)
    codes, supers = _panel_inputs(g, name, pw)
    return g.op1("BlockGather", [ids, *codes, *supers], domain=OP_DOMAIN, K=pw.k, N=pw.n, bits=pw.bits,
                 block_size=pw.block_size)


def _block_sums(g: Graph, x: str, q: BlockQuantized) -> str:
    """x [T, K] summed over each block of K: [T, K / block_size]."""
    shape = g.shared_const(f"const.blocks_{q.n_blocks}x{q.block_size}", np.array([-1, q.n_blocks, q.block_size], np.int64))
    return g.op1("ReduceSum", [g.op1("Reshape", [x, shape]), g.shared_const("const.axis2", np.array([2], np.int64))],
                 keepdims=0)


def _mins_term(g: Graph, name: str, blocks: Blocks, sums: str) -> str:
    assert blocks.mins is not None
    return g.op1("MatMul", [sums, g.weight(name + ".mins", [np.ascontiguousarray(blocks.mins.T)])])
