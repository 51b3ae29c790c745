"""Build the ONNX graph of a Llama-family decoder directly from its weights (no tracing).

Per layer: RMSNorm -> fused qkv Gemm (+ optional bias) -> (Qwen3: per-head RMSNorm of q and k) -> RoPE
(rotate_half, as HF; YaRN's attention factor squared goes into the op's scale) -> ONE
`octavo.PagedAttention` node (which writes the new K/V into that layer's pool in place) -> o_proj ->
residual -> RMSNorm -> fused gate/up Gemm -> SiLU(gate) * up -> down_proj -> residual. After the last
layer only the rows in `logits_indices` are gathered, then final norm + lm_head, so a prefill of T
tokens pays the vocabulary projection only for the rows that need a next token.

Linear weights stay in HF's [out, in] layout and run as Gemm(transB=1): the bytes are copied straight
from the checkpoint, and q/k/v (and gate/up) are written back to back as one fused tensor. With a
QuantConfig (int8/int4) they are blockwise-quantized instead (octavo.export.quantize), with "gguf" the file's
own blocks are kept (octavo.export.gguf_blocks); either runs as octavo.BlockMatMul (the default kernel) or
ONNX Runtime's com.microsoft.MatMulNBits; the embedding (and, unless asked, lm_head) stays float32.

Gemma 2 / Gemma 3 (ModelSpec options, Llama defaults): embeddings times sqrt(hidden_size), RMSNorm weights
stored as (1 + w) in float32 (HF computes the same sum in float32), sandwich norms (the attention and MLP
outputs are normalized before their residual adds, the MLP input by pre_feedforward_layernorm),
gelu_pytorch_tanh as plain ONNX ops, the attention scale query_pre_attn_scalar^-0.5, the op's softcap
(Gemma 2) and a final logit softcap c*tanh(logits/c). Gemma 3's sliding layers rotate with a second
table, `rope.inv_freq.local` (rope_local_base_freq); its global layers with `rope.inv_freq`.

`build_model` calls one small builder per part: `_embed`, `_rotaries`, `_layer` (`_attention`, `_mlp`) per layer,
`_head`. The families' differences are data, not branches of one function: ModelSpec's fields (norm_offset,
embed_scale, qk_norm, hidden_act, final_softcap, ...), the activation tables and a layer's norm placement
(`_LayerNorms`: Llama's pre-norms or Gemma's sandwich norms).
The graph contract (names, dtypes, order) is DESIGN.md's "The ONNX contract".
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from octavo.errors import ModelFormatError
from octavo.export.checkpoint import Checkpoint, ModelSpec
from octavo.export.block_layout import PANEL, panel_weights
from octavo.export.gguf_blocks import Blocks, promote
from octavo.export.quantize import MS_DOMAIN, BlockQuantized, QuantConfig, concat, quantize, unpacked
from octavo.export.rope import attention_factor, attention_scale, inv_freq
from octavo.export.weights_file import WeightsFile

OPSET = 17
OP_DOMAIN = "octavo"
OP_TYPE = "PagedAttention"

# graph inputs in contract order: (name, elem type, shape); caches follow per layer
STEP_INPUTS: list[tuple[str, int, list[str | int]]] = [
    ("input_ids", TensorProto.INT64, ["num_tokens"]),
    ("position_ids", TensorProto.INT64, ["num_tokens"]),
    ("cumulative_sequence_length", TensorProto.INT32, ["batch_plus_one"]),
    ("past_seqlens", TensorProto.INT32, ["batch"]),
    ("block_table", TensorProto.INT32, ["batch", "max_blocks"]),
    ("slot_mapping", TensorProto.INT64, ["num_tokens"]),
    ("logits_indices", TensorProto.INT64, ["num_logits"]),
]


def cache_input_names(num_layers: int) -> list[str]:
    """key_cache.0, value_cache.0, key_cache.1, ... (the order of the graph inputs)."""
    return [f"{kind}.{layer}" for layer in range(num_layers) for kind in ("key_cache", "value_cache")]


@dataclass(slots=True)
class _Graph:
    """Nodes and initializers being collected; small constants inline, weights to the data file."""

    weights: WeightsFile
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[TensorProto] = field(default_factory=list)
    _count: int = 0
    _shared: set[str] = field(default_factory=set)

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, domain: str = "", **attrs: object) -> list[str]:
        self._count += 1
        base = f"{op_type.lower()}_{self._count}"
        outputs = [f"{base}:{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=base, domain=domain, **attrs))
        return outputs

    def op1(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        return self.op(op_type, inputs, **attrs)[0]

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(array, name))
        return name

    def shared_const(self, name: str, array: np.ndarray) -> str:
        """A constant used by many nodes: added once."""
        if name not in self._shared:
            self._shared.add(name)
            self.const(name, array)
        return name

    def weight(self, name: str, parts: list[np.ndarray], dtype: str = "<f4") -> str:
        self.initializers.append(self.weights.add(name, parts, dtype))
        return name


@dataclass(slots=True)
class _Weights:
    """Fetches checkpoint tensors and checks their shapes against the spec."""

    checkpoint: Checkpoint

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self.checkpoint.tensor(name)
        if tuple(array.shape) != shape:
            raise ModelFormatError(
                f"{self.checkpoint.source}: tensor {name!r} has shape {tuple(array.shape)}, the config implies {shape}"
            )
        return array

    def blocks(self, parts: list[Part]) -> Blocks | None:
        """The PARTS' own quantized blocks stacked along N in one layout (gguf_blocks.promote), or None
        when any part has none (a float or unmapped type: the caller keeps the projection float)."""
        found = []
        for name, shape in parts:
            b = self.checkpoint.blocks(name)
            if b is None:
                return None
            if (b.n, b.k) != shape:
                raise ModelFormatError(f"{self.checkpoint.source}: tensor {name!r} has shape {(b.n, b.k)}, "
                                       f"the config implies {shape}")
            found.append(b)
        return promote(found)

    def bias(self, name: str, size: int) -> np.ndarray | None:
        return self.get(name, (size,)) if name in self.checkpoint.tensor_names else None


def _rms_norm(g: _Graph, x: str, weight: str, eps: str) -> str:
    """HF RMSNorm: x / sqrt(mean(x^2) + eps) * weight (the pattern ORT fuses)."""
    mean = g.op1("ReduceMean", [g.op1("Pow", [x, "const.two"])], axes=[-1], keepdims=1)
    return g.op1("Mul", [g.op1("Div", [x, g.op1("Sqrt", [g.op1("Add", [mean, eps])])]), weight])


Bias = tuple[str, list[np.ndarray]]  # (initializer name, parts stacked along N)
Part = tuple[str, tuple[int, int]]  # (checkpoint tensor name, its [out, in] shape)


def _project(g: _Graph, w: _Weights, x: str, name: str, parts: list[Part], bias: Bias | None,
             quant: QuantConfig | None, output: str | None = None) -> str:
    """x @ W^T (+ bias), W = the PARTS stacked along N: Gemm(transB) over the float32 weight; with an
    int8/int4 QUANT, our blockwise quantization of it; with the "gguf" QUANT, the file's own blocks (exact;
    a float Gemm where a part's type has no exact layout). Quantized weights go through octavo.BlockMatMul
    (quant.kernel "block", the default) or MatMulNBits ("matmulnbits"). OUTPUT names the result."""
    return _project_parts(g, w, x, name, parts, bias, quant, None, output)[0]


MAX_BLOCK_OUTPUTS = 4  # octavo::Outputs::kMax (plugins/onnxruntime/block_matmul_kernel.h)


def _project_parts(g: _Graph, w: _Weights, x: str, name: str, parts: list[Part], bias: Bias | None,
                   quant: QuantConfig | None, split: tuple[str, list[int]] | None,
                   output: str | None = None) -> list[str]:
    """_project, and with SPLIT = (the name of a shared constant, sizes) its result split along N into those
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

    blocks = w.blocks(parts) if quant is not None and quant.native else None
    if blocks is not None:
        if quant.block_kernel:
            return block_matmul(blocks)
        return then_split(_project_blocks(g, x, name, blocks, bias, quant, output))
    floats = [w.get(part, shape) for part, shape in parts]
    if quant is None or not quant.enabled or quant.native:
        inputs = [x, g.weight(name, floats)] + ([g.weight(*bias)] if bias else [])
        return then_split(_emit(g, "Gemm", inputs, output, transB=1))
    q = concat([quantize(p, quant.bits or 0, quant.block_size) for p in floats])
    if quant.block_kernel and q.k % q.block_size == 0:  # BlockMatMul has no partial last block
        codes, zero = unpacked(q)
        return block_matmul(Blocks(codes, q.scales, zero, None, q.bits, (quant.weights,)))
    return then_split(_matmulnbits(g, x, name, q, bias, quant.accuracy_level, output))


def _matmulnbits(g: _Graph, x: str, name: str, q: BlockQuantized, bias: Bias | None, accuracy_level: int,
                 output: str | None) -> str:
    inputs = [x, g.weight(name + ".qweight", [q.packed], "u1"), g.weight(name + ".scales", [q.scales]),
              g.weight(name + ".zero_points", [q.zero_points], "u1")]
    inputs += ["", g.weight(*bias)] if bias else []  # input 4 (g_idx) unused; 5 is the bias
    return _emit(g, "MatMulNBits", inputs, output, domain=MS_DOMAIN, K=q.k, N=q.n, bits=q.bits,
                 block_size=q.block_size, accuracy_level=accuracy_level)


def _project_blocks(g: _Graph, x: str, name: str, blocks: Blocks, bias: Bias | None, quant: QuantConfig,
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
        return _emit(g, "Add", [_matmulnbits(g, x, name, q, bias, quant.accuracy_level, None),
                                _mins_term(g, name, blocks, _block_sums(g, x, q))], output)
    outs = g.op("Int8Residual", [x], num_outputs=2 if blocks.mins is not None else 1, domain=OP_DOMAIN,
                block_size=q.block_size, max_rows=quant.residual_rows)
    x2, sums = outs[0], outs[-1]
    y2 = _matmulnbits(g, x2, name, q, None, quant.accuracy_level, None)
    fold = [y2, x] + ([_mins_term(g, name, blocks, sums)] if blocks.mins is not None else [])
    if bias is None:
        return _emit(g, "FoldRows", fold, output, domain=OP_DOMAIN)
    return _emit(g, "Add", [g.op1("FoldRows", fold, domain=OP_DOMAIN), g.weight(*bias)], output)


DECODE_STEP = "decode_step"  # bool [1]: num_tokens == batch, every sequence of the step has one query token


def _decode_step(g: _Graph) -> str:
    """DECODE_STEP, computed once from the shapes of input_ids and past_seqlens and shared by every BlockMatMul:
    a decode-only step takes the op's 16-bit path at any batch size, any other step past 8 rows its float32 one
    (a prompt's logits stay float32 over the file's values)."""
    if DECODE_STEP not in g._shared:
        g._shared.add(DECODE_STEP)
        tokens, batch = g.op1("Shape", ["input_ids"]), g.op1("Shape", ["past_seqlens"])
        g.nodes.append(helper.make_node("Equal", [tokens, batch], [DECODE_STEP], name=DECODE_STEP))
    return DECODE_STEP


def _block_matmul(g: _Graph, x: str, name: str, blocks: Blocks, bias: Bias | None, output: str | None,
                  splits: list[int] | None = None, *, bf16: bool = False) -> list[str]:
    """octavo.BlockMatMul over BLOCKS (a GGUF's own, or octavo's int8/int4 quantization; layout:
    octavo.export.block_layout): its one output (named OUTPUT), or with SPLITS one output per part. BF16 (the
    block-bf16 kernel): the attribute prompt_bf16 = 1 (absent otherwise: block exports are unchanged)."""
    pw = panel_weights(blocks)
    scale_type = "f2" if pw.scales.dtype == np.float16 else "f4"
    inputs = [x, g.weight(name + ".codes", [pw.codes], "u1"), g.weight(name + ".scales", [pw.scales], scale_type),
              g.weight(name + ".offsets", [pw.offsets], scale_type), g.weight(*bias) if bias else "", _decode_step(g)]
    extra: dict[str, int] = {"prompt_bf16": 1} if bf16 else {}
    if splits is not None:
        return g.op("BlockMatMul", inputs, num_outputs=len(splits), domain=OP_DOMAIN, K=pw.k, N=pw.n, bits=pw.bits,
                    block_size=pw.block_size, splits=splits, **extra)
    return [_emit(g, "BlockMatMul", inputs, output, domain=OP_DOMAIN, K=pw.k, N=pw.n, bits=pw.bits,
                  block_size=pw.block_size, **extra)]


def _block_sums(g: _Graph, x: str, q: BlockQuantized) -> str:
    """x [T, K] summed over each block of K: [T, K / block_size]."""
    shape = g.shared_const(f"const.blocks_{q.n_blocks}x{q.block_size}", np.array([-1, q.n_blocks, q.block_size], np.int64))
    return g.op1("ReduceSum", [g.op1("Reshape", [x, shape]), g.shared_const("const.axis2", np.array([2], np.int64))],
                 keepdims=0)


def _mins_term(g: _Graph, name: str, blocks: Blocks, sums: str) -> str:
    assert blocks.mins is not None
    return g.op1("MatMul", [sums, g.weight(name + ".mins", [np.ascontiguousarray(blocks.mins.T)])])


def _emit(g: _Graph, op_type: str, inputs: list[str], output: str | None, domain: str = "", **attrs: object) -> str:
    """One node; its output named OUTPUT, or a fresh name when None."""
    if output is None:
        return g.op1(op_type, inputs, domain=domain, **attrs)
    g.nodes.append(helper.make_node(op_type, inputs, [output], name=output, domain=domain, **attrs))
    return output


def _rope(g: _Graph, x: str, heads: int, head_dim: int, cos: str, sin: str) -> str:
    """x * cos + rotate_half(x) * sin over [T, heads, head_dim]; rotate_half(x) = [-x2, x1]."""
    shaped = g.op1("Reshape", [x, f"const.heads_shape_{heads}"])
    x1, x2 = g.op("Split", [shaped, "const.half_split"], num_outputs=2, axis=2)
    rotated = g.op1("Concat", [g.op1("Neg", [x2]), x1], axis=2)
    out = g.op1("Add", [g.op1("Mul", [shaped, cos]), g.op1("Mul", [rotated, sin])])
    return g.op1("Reshape", [out, f"const.flat_shape_{heads}"])


def _gelu_tanh(g: _Graph, x: str) -> str:
    """gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), float32 as torch computes it."""
    cube = g.op1("Mul", [g.op1("Mul", [x, x]), x])
    inner = g.op1("Mul", [g.op1("Add", [x, g.op1("Mul", [cube, "const.gelu_kappa"])]), "const.gelu_beta"])
    return g.op1("Mul", [g.op1("Mul", [x, "const.half"]), g.op1("Add", [g.op1("Tanh", [inner]), "const.one"])])


def _rope_tables(g: _Graph, positions: str, name: str, theta: float, head_dim: int,
                 scaling: dict | None) -> tuple[str, str]:
    """(cos, sin) [T, 1, head_dim] of this step's positions: angle = position * inv_freq (float32, as HF);
    the inverse frequencies go in the initializer NAME (the backend's RoPE fusion reads it)."""
    freq = g.const(name, inv_freq(theta, head_dim, scaling))
    half = g.op1("Mul", [positions, freq])  # [T, D/2]
    angles = g.op1("Unsqueeze", [g.op1("Concat", [half, half], axis=1), "const.axis1"])  # [T, 1, D]
    return g.op1("Cos", [angles]), g.op1("Sin", [angles])


def _attention_scale(spec: ModelSpec, scaling: dict | None) -> float:
    """The op's q.k scale: head_dim^-0.5 (Gemma: query_pre_attn_scalar^-0.5), times rope's attention factor^2."""
    if spec.query_scale is None:
        return attention_scale(spec.head_dim, scaling)
    return spec.query_scale * attention_factor(scaling) ** 2


def _head_rms_norm(g: _Graph, x: str, heads: int, weight: str, eps: str) -> str:
    """RMSNorm of each head of X [T, heads*head_dim] over head_dim (Qwen3's q_norm / k_norm); the result is
    flat again, the layout `_rope` (and the backend's RoPE fusion, which matches on it) expects."""
    shaped = g.op1("Reshape", [x, f"const.heads_shape_{heads}"])
    return g.op1("Reshape", [_rms_norm(g, shaped, weight, eps), f"const.flat_shape_{heads}"])


# the MLP activation of gate, by ModelSpec.hidden_act: its graph, and the scalar constants that graph reads
_ACTIVATIONS: dict[str, Callable[[_Graph, str], str]] = {
    "silu": lambda g, gate: g.op1("Mul", [gate, g.op1("Sigmoid", [gate])]),
    "gelu_pytorch_tanh": _gelu_tanh,
}
_ACTIVATION_CONSTANTS: dict[str, dict[str, float]] = {
    "silu": {},
    "gelu_pytorch_tanh": {"const.one": 1.0, "const.half": 0.5, "const.gelu_kappa": 0.044715,
                          "const.gelu_beta": float(np.sqrt(2.0 / np.pi))},
}


@dataclass(frozen=True, slots=True)
class _LayerNorms:
    """A layer's RMSNorms by checkpoint name: before the attention and the MLP (every family), and after each,
    before its residual add (None: no such norm)."""

    attention_in: str
    attention_out: str | None
    mlp_in: str
    mlp_out: str | None


_PRE_NORMS = _LayerNorms("input_layernorm", None, "post_attention_layernorm", None)  # Llama, Qwen, Phi-3
_SANDWICH_NORMS = _LayerNorms("input_layernorm", "post_attention_layernorm",  # Gemma (ModelSpec.sandwich_norms)
                              "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True, slots=True)
class _Rotary:
    """A rotary table of this step's positions, (cos, sin), and the attention scale that goes with it."""

    tables: tuple[str, str]
    scale: float


@dataclass(slots=True)
class _Decoder:
    """What the builders of one export share: the graph being written, the checkpoint's tensors, the spec (whose
    fields carry the families' differences) and the weight format."""

    g: _Graph
    w: _Weights
    spec: ModelSpec
    quant: QuantConfig | None
    eps: str = "const.eps"

    def norm_weight(self, name: str, size: int) -> str:
        """The RMSNorm weight NAME; Gemma stores w, applied as (spec.norm_offset + w), summed in float32."""
        array = self.w.get(name, (size,))
        if self.spec.norm_offset:
            array = np.float32(self.spec.norm_offset) + array.astype(np.float32)
        return self.g.weight(name, [array])

    def norm(self, x: str, name: str) -> str:
        """RMSNorm over hidden_size of X by the checkpoint's weight NAME."""
        return _rms_norm(self.g, x, self.norm_weight(name, self.spec.hidden_size), self.eps)


def _add_constants(d: _Decoder) -> None:
    """The constants the layers share: the activation's scalars, eps, the head shapes."""
    g, spec, D = d.g, d.spec, d.spec.head_dim
    g.const("const.two", np.array(2.0, np.float32))
    if spec.hidden_act not in _ACTIVATIONS:
        raise ModelFormatError(f"hidden activation {spec.hidden_act!r} has no graph (silu, gelu_pytorch_tanh)")
    for name, value in _ACTIVATION_CONSTANTS[spec.hidden_act].items():
        g.const(name, np.array(value, np.float32))
    g.const(d.eps, np.array(spec.rms_norm_eps, np.float32))
    g.const("const.half_split", np.array([D // 2, D // 2], np.int64))
    for heads in sorted({spec.num_heads, spec.num_kv_heads}):
        g.const(f"const.heads_shape_{heads}", np.array([-1, heads, D], np.int64))
        g.const(f"const.flat_shape_{heads}", np.array([-1, heads * D], np.int64))


def _embed(d: _Decoder) -> tuple[str, str]:
    """(input_ids' embedding rows, times spec.embed_scale (Gemma), the embedding initializer's name)."""
    g, spec = d.g, d.spec
    embed = g.weight("model.embed_tokens.weight",
                     [d.w.get("model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size))])
    x = g.op1("Gather", [embed, "input_ids"], axis=0)
    if spec.embed_scale != 1.0:
        x = g.op1("Mul", [x, g.const("const.embed_scale", np.array(spec.embed_scale, np.float32))])
    return x, embed


def _rotaries(d: _Decoder) -> tuple[_Rotary, _Rotary]:
    """(the global rotary, the local one) of this step's positions: Gemma 3's sliding layers rotate with their
    own table, rope.inv_freq.local (rope_local_base_freq); any other model's local rotary is its global one."""
    g, spec = d.g, d.spec
    positions = g.op1("Unsqueeze", [g.op1("Cast", ["position_ids"], to=TensorProto.FLOAT),
                                    g.const("const.axis1", np.array([1], np.int64))])
    rotary = _Rotary(_rope_tables(g, positions, "rope.inv_freq", spec.rope_theta, spec.head_dim, spec.rope_scaling),
                     _attention_scale(spec, spec.rope_scaling))
    if spec.local_rope_theta is None or not spec.local_rope_layers:
        return rotary, rotary
    local = _Rotary(_rope_tables(g, positions, "rope.inv_freq.local", spec.local_rope_theta, spec.head_dim,
                                 spec.local_rope_scaling),
                    _attention_scale(spec, spec.local_rope_scaling))
    return rotary, local


def _stacked_bias(w: _Weights, name: str, parts: list[tuple[str, int]]) -> Bias | None:
    """The bias NAME of a projection whose PARTS (checkpoint bias name, size) are stacked along N: None when the
    checkpoint has none of them, zeros for the parts it lacks."""
    biases = [w.bias(part, size) for part, size in parts]
    if all(b is None for b in biases):
        return None
    return name, [b if b is not None else np.zeros(size, np.float32) for b, (_, size) in zip(biases, parts)]


def _fused_projection(d: _Decoder, x: str, prefix: str, fused: str, parts: list[tuple[str, int]],
                      split: str) -> list[str]:
    """X through the projections PARTS (name under PREFIX, output size) written as one weight PREFIX+FUSED, the
    result split per part (SPLIT: the name of the shared split sizes constant): q/k/v, gate/up."""
    hidden = d.spec.hidden_size
    weights: list[Part] = [(prefix + name + ".weight", (size, hidden)) for name, size in parts]
    bias = _stacked_bias(d.w, prefix + fused + ".bias", [(prefix + name + ".bias", size) for name, size in parts])
    return _project_parts(d.g, d.w, x, prefix + fused + ".weight", weights, bias, d.quant,
                          (split, [size for _, size in parts]))


def _linear(d: _Decoder, x: str, name: str, shape: tuple[int, int]) -> str:
    """X through the checkpoint's projection NAME: NAME.weight [out, in] (SHAPE), NAME.bias where it has one."""
    bias = _stacked_bias(d.w, name + ".bias", [(name + ".bias", shape[0])])
    return _project(d.g, d.w, x, name + ".weight", [(name + ".weight", shape)], bias, d.quant)


def _paged_attention(d: _Decoder, q: str, k: str, v: str, layer: int, scale: float) -> str:
    """LAYER's octavo.PagedAttention node (it writes the new K/V into the layer's pool in place); its output."""
    spec, quant = d.spec, d.quant
    return d.g.op(
        OP_TYPE,
        [q, k, v, f"key_cache.{layer}", f"value_cache.{layer}",
         "cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping"],
        num_outputs=3, domain=OP_DOMAIN,
        num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads, scale=scale,
        sliding_window=spec.sliding_windows[layer], softcap=spec.attn_softcap,
        **({"prompt_bf16": 1} if quant is not None and quant.prompt_bf16 else {}),
    )[0]


def _attention(d: _Decoder, h: str, layer: int, rotary: _Rotary) -> str:
    """LAYER's self-attention of the normed H: fused q/k/v, per-head RMSNorm of q and k (spec.qk_norm: Qwen3,
    Gemma 3), RoPE, PagedAttention, o_proj."""
    g, spec, a = d.g, d.spec, f"model.layers.{layer}.self_attn."
    nq, nkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = _fused_projection(d, h, a, "qkv_proj", [("q_proj", nq * D), ("k_proj", nkv * D), ("v_proj", nkv * D)],
                                "const.split_qkv")
    if spec.qk_norm:  # over head_dim of every q and k head, before RoPE
        q = _head_rms_norm(g, q, nq, d.norm_weight(a + "q_norm.weight", D), d.eps)
        k = _head_rms_norm(g, k, nkv, d.norm_weight(a + "k_norm.weight", D), d.eps)
    cos, sin = rotary.tables
    q, k = _rope(g, q, nq, D, cos, sin), _rope(g, k, nkv, D, cos, sin)
    return _linear(d, _paged_attention(d, q, k, v, layer, rotary.scale), a + "o_proj", (spec.hidden_size, nq * D))


def _mlp(d: _Decoder, h: str, layer: int) -> str:
    """LAYER's MLP of the normed H: down_proj(activation(gate) * up), gate/up as one fused projection."""
    spec, m = d.spec, f"model.layers.{layer}.mlp."
    I = spec.intermediate_size  # noqa: E741 - HF's name
    gate, up = _fused_projection(d, h, m, "gate_up_proj", [("gate_proj", I), ("up_proj", I)], "const.split_mlp")
    act = d.g.op1("Mul", [_ACTIVATIONS[spec.hidden_act](d.g, gate), up])
    return _linear(d, act, m + "down_proj", (spec.hidden_size, I))


def _layer(d: _Decoder, x: str, layer: int, rotary: _Rotary) -> str:
    """One decoder layer: x + attention(norm(x)), then + mlp(norm(x)); with sandwich norms (Gemma) each block's
    output is normed too, before its residual add."""
    p, norms = f"model.layers.{layer}.", _SANDWICH_NORMS if d.spec.sandwich_norms else _PRE_NORMS
    o = _attention(d, d.norm(x, p + norms.attention_in + ".weight"), layer, rotary)
    if norms.attention_out is not None:
        o = d.norm(o, p + norms.attention_out + ".weight")
    x = d.g.op1("Add", [x, o])
    down = _mlp(d, d.norm(x, p + norms.mlp_in + ".weight"), layer)
    if norms.mlp_out is not None:
        down = d.norm(down, p + norms.mlp_out + ".weight")
    return d.g.op1("Add", [x, down])


def _lm_head(d: _Decoder, normed: str, embed: str, output: str) -> None:
    """The vocabulary projection of NORMED into OUTPUT: a GGUF's own blocks (a tied model: its embedding's), our
    quantization when quant.lm_head asks for it (the Gather keeps the float embedding), else a float Gemm over
    lm_head.weight or, tied, the embedding initializer EMBED itself."""
    g, w, quant, spec = d.g, d.w, d.quant, d.spec
    tied = spec.tie_word_embeddings or "lm_head.weight" not in w.checkpoint.tensor_names
    part: Part = ("model.embed_tokens.weight" if tied else "lm_head.weight", (spec.vocab_size, spec.hidden_size))
    blocks = w.blocks([part]) if quant is not None and quant.native else None
    if blocks is not None:
        _project_blocks(g, normed, "lm_head.weight", blocks, None, quant, output)
    elif quant is not None and quant.enabled and not quant.native and quant.lm_head:
        _project(g, w, normed, "lm_head.weight", [part], None, quant, output=output)
    else:
        head = embed if tied else g.weight("lm_head.weight", [w.get(*part)])
        g.nodes.append(helper.make_node("Gemm", [normed, head], [output], name="lm_head", transB=1))


def _head(d: _Decoder, x: str, embed: str) -> None:
    """The logits of the rows in logits_indices only: final norm, lm_head, and (Gemma 2) c * tanh(logits / c)."""
    g, cap = d.g, d.spec.final_softcap
    normed = d.norm(g.op1("Gather", [x, "logits_indices"], axis=0), "model.norm.weight")
    _lm_head(d, normed, embed, "logits.uncapped" if cap else "logits")
    if cap:
        c = g.const("const.final_softcap", np.array(cap, np.float32))
        capped = g.op1("Tanh", [g.op1("Div", ["logits.uncapped", c])])
        g.nodes.append(helper.make_node("Mul", [capped, c], ["logits"], name="final_softcap"))


def _model_proto(g: _Graph, spec: ModelSpec, quant: QuantConfig | None) -> onnx.ModelProto:
    """The collected nodes and initializers as a model with the contract's inputs and output."""
    cache_shape: list[str | int] = ["num_blocks", "block_size", spec.num_kv_heads, spec.head_dim]
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in STEP_INPUTS]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache_shape) for n in cache_input_names(spec.num_layers)]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["num_logits", spec.vocab_size])]
    graph = helper.make_graph(g.nodes, "octavo_decoder", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(OP_DOMAIN, 1)]
        + ([helper.make_opsetid(MS_DOMAIN, 1)] if quant is not None and quant.enabled else []),
        producer_name="octavo",
    )
    model.ir_version = 8
    return model


def build_model(
    spec: ModelSpec,
    checkpoint: Checkpoint,
    weights: WeightsFile,
    on_layer: Callable[[int], None] = lambda layer: None,
    quant: QuantConfig | None = None,
) -> onnx.ModelProto:
    """The ONNX model; weights are appended to WEIGHTS as they are visited (one layer at a time).
    QUANT (int8/int4/gguf) stores the linear layers' weights quantized (BlockMatMul or MatMulNBits).
    ON_LAYER is called after the embedding (-1), each layer, and the head (num_layers)."""
    d = _Decoder(_Graph(weights), _Weights(checkpoint), spec, quant)
    _add_constants(d)
    x, embed = _embed(d)
    global_rotary, local_rotary = _rotaries(d)
    on_layer(-1)
    for layer in range(spec.num_layers):
        x = _layer(d, x, layer, local_rotary if layer in spec.local_rope_layers else global_rotary)
        on_layer(layer)
    _head(d, x, embed)
    on_layer(spec.num_layers)
    return _model_proto(d.g, spec, quant)
