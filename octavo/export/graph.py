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
ONNX Runtime's com.microsoft.MatMulNBits; the embedding (and, unless asked, lm_head) stays float32. The linear
layers are octavo.export.projection's; the nodes and initializers are collected by octavo.export.graph_builder.

Gemma 2 / Gemma 3 (ModelSpec options, Llama defaults): embeddings times sqrt(hidden_size), RMSNorm weights
stored as (1 + w) in float32 (HF computes the same sum in float32), sandwich norms (the attention and MLP
outputs are normalized before their residual adds, the MLP input by pre_feedforward_layernorm),
gelu_pytorch_tanh as plain ONNX ops, the attention scale query_pre_attn_scalar^-0.5, the op's softcap
(Gemma 2) and a final logit softcap c*tanh(logits/c). Gemma 3's sliding layers rotate with a second
table, `rope.inv_freq.local` (rope_local_base_freq); its global layers with `rope.inv_freq`.
Partial rotary (Phi-4-mini: ModelSpec.rotary_dim) turns the first rotary_dim values of each head and passes the
rest; a rope attention factor (longrope, yarn) then scales cos and sin instead of the op's scale, since it must
not reach the passed values. SmolLM3's NoPE layers (ModelSpec.nope_layers) skip the rotary embedding.

`build_model` calls one small builder per part: `_embed`, `_rotaries`, `_layer` (`_attention`, `_mlp`) per layer,
`_head`. The families' differences are data, not branches of one function: ModelSpec's fields (norm_offset,
embed_scale, qk_norm, hidden_act, final_softcap, ...), the activation tables and a layer's norm placement
(`_LayerNorms`: Llama's pre-norms or Gemma's sandwich norms).
The graph contract (names, dtypes, order) is DESIGN.md's "The ONNX contract".
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from octavo.errors import ModelFormatError
from octavo.export.checkpoint import Checkpoint, ModelSpec
from octavo.export.graph_builder import OP_DOMAIN, CheckpointTensors, Graph, Part
from octavo.export.moe_graph import moe_block
from octavo.export.projection import Bias, block_gather, project, project_blocks, project_parts
from octavo.export.quantize import MS_DOMAIN, QuantConfig
from octavo.export.rope import attention_factor, attention_scale, inv_freq
from octavo.export.weights_file import WeightsFile

OPSET = 17
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


# an embedding export's extra input (after the pools) and output (after the logits): docs/architecture.md
HIDDEN_INPUT: tuple[str, int, list[str | int]] = ("hidden_indices", TensorProto.INT64, ["num_hidden"])
HIDDEN_OUTPUT = "hidden_states"


def cache_input_names(num_layers: int) -> list[str]:
    """key_cache.0, value_cache.0, key_cache.1, ... (the order of the graph inputs)."""
    return [f"{kind}.{layer}" for layer in range(num_layers) for kind in ("key_cache", "value_cache")]


def _rms_norm(g: Graph, x: str, weight: str, eps: str) -> str:
    """HF RMSNorm: x / sqrt(mean(x^2) + eps) * weight (the pattern ORT fuses)."""
    mean = g.op1("ReduceMean", [g.op1("Pow", [x, "const.two"])], axes=[-1], keepdims=1)
    return g.op1("Mul", [g.op1("Div", [x, g.op1("Sqrt", [g.op1("Add", [mean, eps])])]), weight])


def _rope(g: Graph, x: str, heads: int, head_dim: int, cos: str, sin: str, rotary_dim: int = 0) -> str:
    """x * cos + rotate_half(x) * sin over [T, heads, head_dim]; rotate_half(x) = [-x2, x1]. With ROTARY_DIM
    (partial rotary, < head_dim) only each head's first rotary_dim values turn, the rest pass unchanged."""
    shaped = g.op1("Reshape", [x, f"const.heads_shape_{heads}"])
    turned, passed = shaped, None
    if rotary_dim and rotary_dim < head_dim:
        turned, passed = g.op("Split", [shaped, "const.rotary_split"], num_outputs=2, axis=2)
    x1, x2 = g.op("Split", [turned, "const.half_split"], num_outputs=2, axis=2)
    rotated = g.op1("Concat", [g.op1("Neg", [x2]), x1], axis=2)
    out = g.op1("Add", [g.op1("Mul", [turned, cos]), g.op1("Mul", [rotated, sin])])
    if passed is not None:
        out = g.op1("Concat", [out, passed], axis=2)
    return g.op1("Reshape", [out, f"const.flat_shape_{heads}"])


def _gelu_tanh(g: Graph, x: str) -> str:
    """gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), float32 as torch computes it."""
    cube = g.op1("Mul", [g.op1("Mul", [x, x]), x])
    inner = g.op1("Mul", [g.op1("Add", [x, g.op1("Mul", [cube, "const.gelu_kappa"])]), "const.gelu_beta"])
    return g.op1("Mul", [g.op1("Mul", [x, "const.half"]), g.op1("Add", [g.op1("Tanh", [inner]), "const.one"])])


def _rope_tables(g: Graph, positions: str, name: str, theta: float, head_dim: int,
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


def _head_rms_norm(g: Graph, x: str, heads: int, weight: str, eps: str) -> str:
    """RMSNorm of each head of X [T, heads*head_dim] over head_dim (Qwen3's q_norm / k_norm); the result is
    flat again, the layout `_rope` (and the backend's RoPE fusion, which matches on it) expects."""
    shaped = g.op1("Reshape", [x, f"const.heads_shape_{heads}"])
    return g.op1("Reshape", [_rms_norm(g, shaped, weight, eps), f"const.flat_shape_{heads}"])


# the MLP activation of gate, by ModelSpec.hidden_act: its graph, and the scalar constants that graph reads
_ACTIVATIONS: dict[str, Callable[[Graph, str], str]] = {
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
    """A rotary table of this step's positions, (cos, sin), and the attention scale that goes with it; tables
    None: a layer without rotary embedding (SmolLM3's NoPE layers)."""

    tables: tuple[str, str] | None
    scale: float


@dataclass(slots=True)
class _Decoder:
    """What the builders of one export share: the graph being written, the checkpoint's tensors, the spec (whose
    fields carry the families' differences) and the weight format."""

    g: Graph
    w: CheckpointTensors
    spec: ModelSpec
    quant: QuantConfig | None
    eps: str = "const.eps"

    def norm_weight(self, name: str, size: int) -> str:
        """The RMSNorm weight NAME; Gemma stores w, applied as (spec.norm_offset + w), summed in float32. Added
        once (the final norm serves both the logits and the hidden states)."""
        if not self.g.first_use("norm:" + name):
            return name
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
    R = spec.rotary_size  # noqa: N806 - the rotated part of a head
    g.const("const.half_split", np.array([R // 2, R // 2], np.int64))
    if R < D:
        g.const("const.rotary_split", np.array([R, D - R], np.int64))
    for heads in sorted({spec.num_heads, spec.num_kv_heads}):
        g.const(f"const.heads_shape_{heads}", np.array([-1, heads, D], np.int64))
        g.const(f"const.flat_shape_{heads}", np.array([-1, heads * D], np.int64))


EMBEDDING = "model.embed_tokens.weight"


def _embed(d: _Decoder) -> tuple[str, str | None]:
    """(input_ids' embedding rows, times spec.embed_scale (Gemma), the float embedding initializer's name). A
    GGUF's own blocks (quant.native) keep the embedding in the file's blocks, gathered by octavo.BlockGather
    (the same float32 values; name None: there is no float copy)."""
    g, spec = d.g, d.spec
    part: Part = (EMBEDDING, (spec.vocab_size, spec.hidden_size))
    blocks = d.w.blocks([part]) if d.quant is not None and d.quant.native else None
    if blocks is not None and blocks.block_size % 4 == 0:
        x, embed = block_gather(g, "input_ids", EMBEDDING, blocks), None
    else:
        embed = g.weight(EMBEDDING, [d.w.get(*part)])
        x = g.op1("Gather", [embed, "input_ids"], axis=0)
    if spec.embed_scale != 1.0:
        x = g.op1("Mul", [x, g.const("const.embed_scale", np.array(spec.embed_scale, np.float32))])
    return x, embed


def _rotary(d: _Decoder, positions: str, name: str, theta: float, scaling: dict | None) -> _Rotary:
    """The rotary table NAME and its attention scale. Rope's attention factor (yarn, longrope) goes into the scale
    (squared: q and k both carry it), except with partial rotary, where it scales cos and sin, so that the values
    that do not turn stay unscaled, as in transformers."""
    g, spec = d.g, d.spec
    cos, sin = _rope_tables(g, positions, name, theta, spec.rotary_size, scaling)
    factor = attention_factor(scaling)
    if spec.rotary_size == spec.head_dim or factor == 1.0:
        return _Rotary((cos, sin), _attention_scale(spec, scaling))
    f = g.const(name + ".attention_factor", np.array(factor, np.float32))
    return _Rotary((g.op1("Mul", [cos, f]), g.op1("Mul", [sin, f])), _attention_scale(spec, None))


def _rotaries(d: _Decoder) -> tuple[_Rotary, _Rotary]:
    """(the global rotary, the local one) of this step's positions: Gemma 3's sliding layers rotate with their
    own table, rope.inv_freq.local (rope_local_base_freq); any other model's local rotary is its global one."""
    g, spec = d.g, d.spec
    positions = g.op1("Unsqueeze", [g.op1("Cast", ["position_ids"], to=TensorProto.FLOAT),
                                    g.const("const.axis1", np.array([1], np.int64))])
    rotary = _rotary(d, positions, "rope.inv_freq", spec.rope_theta, spec.rope_scaling)
    if spec.local_rope_theta is None or not spec.local_rope_layers:
        return rotary, rotary
    return rotary, _rotary(d, positions, "rope.inv_freq.local", spec.local_rope_theta, spec.local_rope_scaling)


def _stacked_bias(w: CheckpointTensors, name: str, parts: list[tuple[str, int]]) -> Bias | None:
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
    return project_parts(d.g, d.w, x, prefix + fused + ".weight", weights, bias, d.quant,
                          (split, [size for _, size in parts]))


def _linear(d: _Decoder, x: str, name: str, shape: tuple[int, int]) -> str:
    """X through the checkpoint's projection NAME: NAME.weight [out, in] (SHAPE), NAME.bias where it has one."""
    bias = _stacked_bias(d.w, name + ".bias", [(name + ".bias", shape[0])])
    return project(d.g, d.w, x, name + ".weight", [(name + ".weight", shape)], bias, d.quant)


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
    if rotary.tables is not None:  # None: a NoPE layer (SmolLM3)
        cos, sin = rotary.tables
        q, k = _rope(g, q, nq, D, cos, sin, spec.rotary_dim), _rope(g, k, nkv, D, cos, sin, spec.rotary_dim)
    return _linear(d, _paged_attention(d, q, k, v, layer, rotary.scale), a + "o_proj", (spec.hidden_size, nq * D))


def _mlp(d: _Decoder, h: str, layer: int) -> str:
    """LAYER's MLP of the normed H: a MoE block on the spec's sparse layers (octavo.export.moe_graph), else dense."""
    moe = d.spec.moe
    if moe is not None and layer in moe.sparse_layers:
        return moe_block(d.g, d.w, moe, layer, d.spec.hidden_size, h, lambda x, m, size: _dense_mlp(d, x, m, size),
                         d.quant)
    return _dense_mlp(d, h, f"model.layers.{layer}.mlp.", d.spec.intermediate_size)


def _dense_mlp(d: _Decoder, h: str, m: str, I: int) -> str:  # noqa: E741 - HF's name
    """The MLP under checkpoint prefix M of the normed H: down_proj(activation(gate) * up), gate/up as one fused
    projection of I rows each."""
    split = "const.split_mlp" if I == d.spec.intermediate_size else f"const.split_mlp_{I}"
    gate, up = _fused_projection(d, h, m, "gate_up_proj", [("gate_proj", I), ("up_proj", I)], split)
    act = d.g.op1("Mul", [_ACTIVATIONS[d.spec.hidden_act](d.g, gate), up])
    return _linear(d, act, m + "down_proj", (d.spec.hidden_size, I))


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


def _lm_head(d: _Decoder, normed: str, embed: str | None, output: str) -> None:
    """The vocabulary projection of NORMED into OUTPUT: a GGUF's own blocks (a tied model: its embedding's, the
    very initializers BlockGather reads when the block kernel runs), our quantization when quant.lm_head asks for
    it (the Gather keeps the float embedding), else a float Gemm over lm_head.weight or, tied, the embedding
    initializer EMBED itself."""
    g, w, quant, spec = d.g, d.w, d.quant, d.spec
    tied = spec.tie_word_embeddings or "lm_head.weight" not in w.checkpoint.tensor_names
    part: Part = (EMBEDDING if tied else "lm_head.weight", (spec.vocab_size, spec.hidden_size))
    blocks = w.blocks([part]) if quant is not None and quant.native else None
    if blocks is not None:
        shared = tied and embed is None and quant.block_kernel
        project_blocks(g, normed, EMBEDDING if shared else "lm_head.weight", blocks, None, quant, output)
    elif quant is not None and quant.enabled and not quant.native and quant.lm_head:
        project(g, w, normed, "lm_head.weight", [part], None, quant, output=output)
    else:
        if tied and embed is None:
            embed = g.weight(EMBEDDING, [w.get(*part)])
        head = embed if tied else g.weight("lm_head.weight", [w.get(*part)])
        g.nodes.append(helper.make_node("Gemm", [normed, head], [output], name="lm_head", transB=1))


def _head(d: _Decoder, x: str, embed: str | None) -> None:
    """The logits of the rows in logits_indices only: final norm, lm_head, and (Gemma 2) c * tanh(logits / c)."""
    g, cap = d.g, d.spec.final_softcap
    normed = d.norm(g.op1("Gather", [x, "logits_indices"], axis=0), "model.norm.weight")
    _lm_head(d, normed, embed, "logits.uncapped" if cap else "logits")
    if cap:
        c = g.const("const.final_softcap", np.array(cap, np.float32))
        capped = g.op1("Tanh", [g.op1("Div", ["logits.uncapped", c])])
        g.nodes.append(helper.make_node("Mul", [capped, c], ["logits"], name="final_softcap"))


def _hidden_states(d: _Decoder, x: str) -> None:
    """An embedding export's second output: the final-normed hidden states of the rows in hidden_indices (the
    engine pools them: runtime/pooling.py)."""
    rows = d.g.op1("Gather", [x, HIDDEN_INPUT[0]], axis=0)
    normed = d.norm(rows, "model.norm.weight")
    d.g.nodes.append(helper.make_node("Identity", [normed], [HIDDEN_OUTPUT], name=HIDDEN_OUTPUT))


def _model_proto(g: Graph, spec: ModelSpec, quant: QuantConfig | None, hidden: bool = False) -> onnx.ModelProto:
    """The collected nodes and initializers as a model with the contract's inputs and output (HIDDEN: and an
    embedding export's hidden_indices input, after the pools, and hidden_states output, after the logits)."""
    cache_shape: list[str | int] = ["num_blocks", "block_size", spec.num_kv_heads, spec.head_dim]
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in STEP_INPUTS]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache_shape) for n in cache_input_names(spec.num_layers)]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["num_logits", spec.vocab_size])]
    if hidden:
        inputs.append(helper.make_tensor_value_info(*HIDDEN_INPUT))
        outputs.append(helper.make_tensor_value_info(HIDDEN_OUTPUT, TensorProto.FLOAT, ["num_hidden", spec.hidden_size]))
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
    hidden_states: bool = False,
) -> onnx.ModelProto:
    """The ONNX model; weights are appended to WEIGHTS as they are visited (one layer at a time).
    QUANT (int8/int4/gguf) stores the linear layers' weights quantized (BlockMatMul or MatMulNBits).
    HIDDEN_STATES (an embedding export): also the hidden_indices input and the hidden_states output.
    ON_LAYER is called after the embedding (-1), each layer, and the head (num_layers)."""
    d = _Decoder(Graph(weights), CheckpointTensors(checkpoint), spec, quant)
    _add_constants(d)
    x, embed = _embed(d)
    global_rotary, local_rotary = _rotaries(d)
    no_rotary = _Rotary(None, _attention_scale(spec, None))  # rope's attention factor comes with cos and sin
    on_layer(-1)
    for layer in range(spec.num_layers):
        rotary = local_rotary if layer in spec.local_rope_layers else global_rotary
        x = _layer(d, x, layer, no_rotary if layer in spec.nope_layers else rotary)
        on_layer(layer)
    if hidden_states:
        _hidden_states(d, x)
    _head(d, x, embed)
    on_layer(spec.num_layers)
    return _model_proto(d.g, spec, quant, hidden_states)
