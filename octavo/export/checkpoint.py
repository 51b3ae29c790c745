"""The neutral checkpoint both front ends (HF safetensors folder, GGUF file) hand to the graph builder.

A `Checkpoint` is an HF-style config dict, a lazy tensor getter over HF tensor names and layouts, the
tokenizer as HF `tokenizers` JSON and the chat template. `ModelSpec` is what the graph builder needs from
the config, validated: only architectures octavo can build pass `spec_from_config`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from octavo.errors import ModelFormatError, UnsupportedArchitectureError
from octavo.export.moe_spec import MOE_ARCHITECTURES, MoeSpec, moe_from_config, moe_sliding_windows
from octavo.export.rope import complete_longrope, complete_yarn

if TYPE_CHECKING:
    from octavo.export.gguf_blocks import Blocks

# HF `architectures` entry -> manifest architecture name
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",  # text only (model_type gemma3_text); the multimodal model is refused
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",  # fused qkv_proj / gate_up_proj, presented split by the Checkpoint
    "SmolLM3ForCausalLM": "smollm3",  # Llama with no rope on the layers no_rope_layers marks 0
    # Mixture-of-Experts (octavo.export.moe_spec): routed experts in one octavo.MoE node per sparse layer
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
# architectures whose attention RMS-normalizes each q and k head (weights self_attn.q_norm / k_norm, [head_dim])
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3", "qwen3_moe")
# Gemma: RMSNorm x * (1 + w), embeddings times sqrt(hidden_size), sandwich norms around attention and MLP,
# gelu_pytorch_tanh MLP, attention scale query_pre_attn_scalar^-0.5, layer types from layer_types
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# transformers' default layer pattern when a Gemma config has no layer_types: every Nth layer is global
GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
# architectures whose config gates the sliding window with use_sliding_window / max_window_layers
GATED_WINDOW_ARCHITECTURES = ("qwen2", "qwen3", "smollm3", "qwen2_moe")
# architectures whose attention rotates only int(head_dim * partial_rotary_factor) values of each head (Phi-4-mini)
PARTIAL_ROTARY_ARCHITECTURES = ("phi3",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# rope types transformers has that octavo refuses, and why
REFUSED_ROPE_TYPES = {
    "dynamic": "transformers recomputes its frequencies from each batch's longest sequence, which a paged "
               "engine serving many lengths in one step cannot reproduce",
}
# rope types an architecture's transformers config renames before use (Phi3Config: "su" and "yarn" are
# old names of longrope, so a phi3 "yarn" is NOT octavo's yarn)
ROPE_TYPE_ALIASES: dict[str, dict[str, str]] = {"phi3": {"su": "longrope", "yarn": "longrope"}}
# fused projections some checkpoints store (Phi-3), presented as the separate tensors the graph builder
# reads: fused suffix -> the parts' suffixes, in row order
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up_proj.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}


@dataclass(slots=True)
class Checkpoint:
    """A model as read from disk, independent of its file format."""

    config: dict[str, Any]
    tensor_names: frozenset[str]
    get_tensor: Callable[[str], np.ndarray]  # HF name -> float32 array in HF layout ([out, in] for linears)
    tokenizer_json: str
    chat_template: str | None
    source: str
    extra_eos_token_ids: list[int] = field(default_factory=list)  # e.g. from generation_config.json
    # HF name -> the file's own quantized blocks (GGUF; octavo.export.gguf_blocks), None where it has none
    get_blocks: Callable[[str], Blocks | None] | None = None

    def __post_init__(self) -> None:
        fused = {n for n in self.tensor_names if any(n.endswith("." + suffix) for suffix in FUSED_PROJECTIONS)}
        if fused:
            self.tensor_names, self.get_tensor, self.get_blocks = _split_fused(self, fused)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.tensor_names:
            raise ModelFormatError(f"{self.source}: tensor {name!r} is missing from the checkpoint")
        return self.get_tensor(name)

    def blocks(self, name: str) -> Blocks | None:
        """The tensor's quantized blocks as the file stores them, or None (float or unmapped type, HF folder)."""
        if name not in self.tensor_names:
            raise ModelFormatError(f"{self.source}: tensor {name!r} is missing from the checkpoint")
        return None if self.get_blocks is None else self.get_blocks(name)


def _split_fused(checkpoint: Checkpoint, fused: set[str]) -> tuple[
        frozenset[str], Callable[[str], np.ndarray], Callable[[str], Blocks | None] | None]:
    """Tensor names and getter with every fused projection (Phi-3's qkv_proj / gate_up_proj) replaced by
    its parts: row slices (views) of the fused tensor. q/k/v rows split as num_attention_heads :
    num_key_value_heads : num_key_value_heads heads (the fused tensor's rows set the head size), gate/up
    in halves, as transformers' Phi3Attention / Phi3MLP slice them."""
    parts: dict[str, tuple[str, int, int]] = {}  # part name -> (fused name, index, number of parts)
    for name in fused:
        suffix = next(s for s in FUSED_PROJECTIONS if name.endswith("." + s))
        prefix = name[: -len(suffix)]
        names = FUSED_PROJECTIONS[suffix]
        clash = [prefix + n for n in names if prefix + n in checkpoint.tensor_names]
        if clash:
            raise ModelFormatError(
                f"{checkpoint.source}: both {name!r} and {clash[0]!r} are present; a checkpoint stores a "
                f"projection either fused or split, not both"
            )
        for index, part in enumerate(names):
            parts[prefix + part] = (name, index, len(names))
    read = checkpoint.get_tensor
    config = checkpoint.config
    source = checkpoint.source

    def row_bounds(fused_name: str, rows: int, index: int, count: int) -> tuple[int, int]:
        if count == 2:
            sizes = [rows // 2, rows // 2]
        else:
            heads = int(config.get("num_attention_heads") or 0)
            kv_heads = int(config.get("num_key_value_heads") or heads)
            total = heads + 2 * kv_heads
            sizes = [rows * heads // total, rows * kv_heads // total, rows * kv_heads // total] if total else []
        if not sizes or sum(sizes) != rows:
            raise ModelFormatError(
                f"{source}: fused tensor {fused_name!r} has {rows} rows, which do not split into {count} parts "
                f"as the config's head counts imply; the checkpoint and its config.json disagree"
            )
        start = sum(sizes[:index])
        return start, start + sizes[index]

    # the last fused tensor read: the graph builder asks for q, k, v (gate, up) in a row, and a GGUF
    # lookup dequantizes the whole fused tensor each time
    last: dict[str, np.ndarray] = {}

    def get_tensor(name: str) -> np.ndarray:
        if name not in parts:
            return read(name)
        fused_name, index, count = parts[name]
        if fused_name not in last:
            last.clear()
            last[fused_name] = read(fused_name)
        whole = last[fused_name]
        start, stop = row_bounds(fused_name, whole.shape[0], index, count)
        return whole[start:stop]

    read_blocks = checkpoint.get_blocks

    def get_blocks(name: str) -> Blocks | None:
        if read_blocks is None or name not in parts:
            return None if read_blocks is None else read_blocks(name)
        fused_name, index, count = parts[name]
        whole = read_blocks(fused_name)
        if whole is None:
            return None
        start, stop = row_bounds(fused_name, whole.n, index, count)
        return whole.rows(slice(start, stop))

    names = frozenset((checkpoint.tensor_names - fused) | parts.keys())
    return names, get_tensor, (get_blocks if read_blocks is not None else None)


@dataclass(slots=True)
class ModelSpec:
    """The shape of the transformer, taken from the config and checked."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    sliding_windows: list[int]  # per layer, 0 = full attention
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    qk_norm: bool = False  # per-head RMSNorm of q and k after the projections, before RoPE (Qwen3, Gemma 3)
    # Gemma options (the defaults are Llama's)
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): Gemma stores w with 1 subtracted
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size), rounded to float32 as HF)
    sandwich_norms: bool = False  # Gemma: post_attention_layernorm on the attention output before the residual
    # add, pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it
    hidden_act: str = "silu"  # MLP activation of gate: "silu" | "gelu_pytorch_tanh"
    query_scale: float | None = None  # q.k scale before rope's attention factor; None = head_dim ** -0.5
    attn_softcap: float = 0.0  # attention scores c * tanh(s / c) (the op's softcap attribute); 0 = none
    final_softcap: float = 0.0  # logits c * tanh(l / c); 0 = none
    # a second rotary table for the layers in local_rope_layers (Gemma 3's sliding layers), None = one table
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    local_rope_layers: list[int] = field(default_factory=list)
    rotary_dim: int = 0  # the rotated part of each head (partial_rotary_factor: Phi-4-mini); 0 = head_dim
    nope_layers: list[int] = field(default_factory=list)  # layers without rotary embedding (SmolLM3)
    moe: MoeSpec | None = None  # Mixture-of-Experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral); None = dense

    @property
    def rotary_size(self) -> int:
        """The number of rotated values of each head."""
        return self.rotary_dim or self.head_dim


def _supported_list() -> str:
    return ", ".join(f"{hf} ({name})" for hf, name in SUPPORTED_ARCHITECTURES.items())


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    named = ", ".join(map(str, archs)) or f"model_type {config.get('model_type')!r}"
    raise UnsupportedArchitectureError(
        f"architecture {named} is not supported; octavo exports {_supported_list()}"
    )


def _required_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFormatError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict with 'rope_type' or None) from either the transformers 4 or 5 layout."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers >= 5
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(config.get("rope_theta", 10000.0))
        scaling = dict(config.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("partial_rotary_factor", None)  # _rotary_dim reads it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = f" ({REFUSED_ROPE_TYPES[rope_type]})" if rope_type in REFUSED_ROPE_TYPES else ""
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} is not supported{why}; octavo supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":  # every default written out, so the manifest records what the graph uses
        top_level = config.get("original_max_position_embeddings")
        context = int(config.get("max_position_embeddings") or 2048)
        return theta, {"rope_type": rope_type, **complete_yarn(scaling, context, top_level)}
    if rope_type == "longrope":  # the choice of factors and the attention factor written out
        try:
            return theta, {"rope_type": rope_type, **complete_longrope(
                scaling, int(config.get("max_position_embeddings") or 2048),
                config.get("original_max_position_embeddings"))}
        except ValueError as exc:
            raise ModelFormatError(f"config.json: {exc}") from exc
    needed = ["factor"] + (
        ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"] if rope_type == "llama3" else []
    )
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ModelFormatError(f"config.json: rope scaling {rope_type!r} lacks {missing}")
    return theta, {"rope_type": rope_type, **scaling}


def _rotary_dim(config: dict[str, Any], architecture: str, head_dim: int) -> int:
    """int(head_dim * partial_rotary_factor) as transformers computes it (0 = the whole head), from the top
    level or (transformers 5) rope_parameters; only architectures whose transformers attention slices the rotated
    part (PARTIAL_ROTARY_ARCHITECTURES) take one."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial in (None, 1, 1.0):
        return 0
    if architecture not in PARTIAL_ROTARY_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor {partial} (rotary embedding on part of each head) is supported for "
            f"{', '.join(PARTIAL_ROTARY_ARCHITECTURES)} only, not {architecture}")
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ModelFormatError(f"config.json: partial_rotary_factor must be in (0, 1], got {partial!r}")
    dim = int(head_dim * partial)
    if dim < 2 or dim % 2:
        raise ModelFormatError(f"config.json: partial_rotary_factor {partial} of head_dim {head_dim} rotates {dim} "
                               "values; rotary embedding needs an even number")
    return dim


def _nope_layers(config: dict[str, Any], num_layers: int) -> list[int]:
    """SmolLM3's layers without rope: no_rope_layers[i] == 0, or (no list) every no_rope_layer_interval-th layer."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ModelFormatError(f"config.json: no_rope_layer_interval must be a positive integer, got {interval!r}")
        return [i for i in range(num_layers) if (i + 1) % interval == 0]
    if not isinstance(flags, list) or len(flags) < num_layers or any(f not in (0, 1) for f in flags[:num_layers]):
        raise ModelFormatError(f"config.json: no_rope_layers must list 0 or 1 for each of the {num_layers} layers, "
                               f"got {flags!r}")
    return [i for i in range(num_layers) if not flags[i]]


def _smollm3_layer_types(config: dict[str, Any], nope: list[int]) -> dict[str, Any]:
    """CONFIG with transformers' default SmolLM3 layer_types when it has none: sliding on the NoPE layers when
    use_sliding_window and sliding_window are set, full elsewhere."""
    if config.get("layer_types") is not None:
        return config
    sliding = bool(config.get("use_sliding_window")) and config.get("sliding_window") is not None
    types = ["sliding_attention" if sliding and i in nope else "full_attention"
             for i in range(int(config["num_hidden_layers"]))]
    return {**config, "layer_types": types}


def _renamed_rope_type(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """CONFIG with its rope type renamed as the architecture's transformers config does (ROPE_TYPE_ALIASES)."""
    aliases = ROPE_TYPE_ALIASES.get(architecture, {})
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if not isinstance(params, dict):
            continue
        for field_name in ("rope_type", "type"):
            if params.get(field_name) in aliases:
                renamed = {k: v for k, v in params.items() if k not in ("rope_type", "type")}
                renamed["rope_type"] = aliases[params[field_name]]
                return {**config, key: renamed}
    return config


def _gemma_layer_types(config: dict[str, Any], architecture: str, num_layers: int) -> list[str]:
    """Gemma's per-layer "sliding_attention" / "full_attention", with transformers' default pattern."""
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelFormatError(f"config.json: layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
        unknown = sorted({str(t) for t in layer_types} - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedArchitectureError(f"layer types {unknown} are not supported (sliding_attention, full_attention)")
        return [str(t) for t in layer_types]
    pattern = int(config.get("sliding_window_pattern") or GEMMA_SLIDING_PATTERN[architecture])
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _sliding_windows(config: dict[str, Any], architecture: str, num_layers: int) -> list[int]:
    window = config.get("sliding_window")
    moe_windows = moe_sliding_windows(config, architecture, num_layers)
    if moe_windows is not None:
        return moe_windows
    if architecture in GEMMA_ARCHITECTURES:
        types = _gemma_layer_types(config, architecture, num_layers)
        return [int(window or 0) if t == "sliding_attention" else 0 for t in types]
    if not window:
        return [0] * num_layers
    if architecture in GATED_WINDOW_ARCHITECTURES and not config.get("use_sliding_window", False):
        return [0] * num_layers  # transformers' Qwen2/Qwen3 configs drop the window unless use_sliding_window
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return [int(window) if t == "sliding_attention" else 0 for t in layer_types]
    if architecture in GATED_WINDOW_ARCHITECTURES:  # transformers 4 layout
        if not config.get("use_sliding_window", False):
            return [0] * num_layers
        # transformers' Qwen3Config defaults max_window_layers to 28 (the first 28 layers attend fully)
        first = int(config.get("max_window_layers", 28 if architecture == "qwen3" else num_layers))
        return [int(window) if i >= first else 0 for i in range(num_layers)]
    return [int(window)] * num_layers


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _positive_float(config: dict[str, Any], key: str) -> float:
    """CONFIG[KEY] as a float, 0.0 when missing or null."""
    value = config.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelFormatError(f"config.json: {key!r} must be a positive number or null, got {value!r}")
    return float(value)


def _gemma_rope(config: dict[str, Any]) -> tuple[tuple[float, dict[str, Any] | None], tuple[float, dict[str, Any] | None]]:
    """Gemma 3's ((global theta, scaling), (local theta, scaling)) from transformers 5's per-layer-type
    rope_parameters, or transformers 4's rope_theta + rope_scaling (global) and rope_local_base_freq (local,
    never scaled). The defaults are transformers': 1e6 global, 1e4 local."""
    params = config.get("rope_parameters")
    context = {k: config[k] for k in ("max_position_embeddings", "original_max_position_embeddings") if k in config}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full = {"rope_theta": 1_000_000.0, **params["full_attention"]}
        local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
        return _rope({**context, "rope_parameters": full}), _rope({**context, "rope_parameters": local})
    full_theta = config.get("rope_theta", 1_000_000.0)
    global_rope = _rope({**context, "rope_theta": full_theta, "rope_scaling": config.get("rope_scaling")})
    return global_rope, (float(config.get("rope_local_base_freq", 10_000.0)), None)


def _gemma_options(config: dict[str, Any], architecture: str, num_layers: int, hidden: int) -> dict[str, Any]:
    """The ModelSpec fields a Gemma 2 / Gemma 3 text model sets (transformers' Gemma2/Gemma3 modeling)."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise UnsupportedArchitectureError(f"{architecture}: hidden_activation {act!r} is not supported "
                                           f"({', '.join(GEMMA_ACTIVATIONS)} only)")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError(
            f"{architecture}: use_bidirectional_attention (an encoder-style model, e.g. EmbeddingGemma) is not "
            "supported; octavo serves causal decoders"
        )
    scalar = config.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ModelFormatError(f"config.json: 'query_pre_attn_scalar' must be a positive number, got {scalar!r}")
    options: dict[str, Any] = dict(
        norm_offset=1.0,
        embed_scale=float(np.float32(hidden ** 0.5)),  # HF: a float32 buffer (bf16 in bf16 models)
        sandwich_norms=True,
        hidden_act=act,
        query_scale=float(scalar) ** -0.5,
        final_softcap=_positive_float(config, "final_logit_softcapping"),
        # transformers' Gemma3Attention never passes attn_logit_softcapping to attention: exact means ignoring it
        attn_softcap=_positive_float(config, "attn_logit_softcapping") if architecture == "gemma2" else 0.0,
    )
    if architecture == "gemma3":
        (theta, scaling), (local_theta, local_scaling) = _gemma_rope(config)
        types = _gemma_layer_types(config, architecture, num_layers)
        options.update(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                       local_rope_scaling=local_scaling,
                       local_rope_layers=[i for i, t in enumerate(types) if t == "sliding_attention"])
    return options


def spec_from_config(config: dict[str, Any], extra_eos_token_ids: Iterable[int] = ()) -> ModelSpec:
    """Validate an HF-style config and derive the model shape. Raises UnsupportedArchitectureError."""
    architecture = _architecture(config)
    if architecture not in GEMMA_ARCHITECTURES and config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedArchitectureError(f"hidden_act {config.get('hidden_act')!r} is not supported (silu only)")
    num_layers = _required_int(config, "num_hidden_layers")
    hidden = _required_int(config, "hidden_size")
    heads = _required_int(config, "num_attention_heads")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelFormatError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ModelFormatError(f"config.json: head_dim {head_dim} must be even for rotary embeddings")
    gemma = _gemma_options(config, architecture, num_layers, hidden) if architecture in GEMMA_ARCHITECTURES else {}
    nope = _nope_layers(config, num_layers) if architecture == "smollm3" else []
    if architecture == "smollm3":
        config = _smollm3_layer_types(config, nope)
    if "rope_theta" in gemma:  # Gemma 3: two rotary tables, read from its per-layer-type rope parameters
        theta, scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
    else:
        theta, scaling = _rope(_renamed_rope_type(config, architecture))
    rotary_dim = _rotary_dim(config, architecture, head_dim)
    if scaling is not None and scaling["rope_type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != (rotary_dim or head_dim) // 2:
                raise ModelFormatError(f"config.json: longrope {key} has {len(scaling[key])} values; the rotary "
                                       f"dimension {rotary_dim or head_dim} needs {(rotary_dim or head_dim) // 2}")
    eos = _token_ids(config.get("eos_token_id"))
    for extra in extra_eos_token_ids:
        if extra not in eos:
            eos.append(int(extra))
    return ModelSpec(
        architecture=architecture,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=_required_int(config, "intermediate_size"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_required_int(config, "vocab_size"),
        max_context=int(config.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_windows=_sliding_windows(config, architecture, num_layers),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id") if isinstance(config.get("bos_token_id"), int) else None,
        eos_token_ids=eos,
        pad_token_id=config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else None,
        qk_norm=architecture in QK_NORM_ARCHITECTURES,
        rotary_dim=rotary_dim,
        nope_layers=nope,
        moe=moe_from_config(config, architecture, num_layers) if architecture in MOE_ARCHITECTURES else None,
        **gemma,
    )
