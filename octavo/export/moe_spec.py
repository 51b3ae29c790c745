"""The Mixture-of-Experts shape of a model (`MoeSpec`), read from an HF-style config: which layers route their
tokens to experts, how many experts, how many each token takes, whether the chosen weights are renormalised, the
shared expert (Qwen2-MoE) and the checkpoint's tensor names. Facts from transformers' Qwen3-MoE, Qwen2-MoE and
Mixtral modeling code:

- Qwen3-MoE / Qwen2-MoE: layer l is sparse when l is not in `mlp_only_layers` and (l + 1) % `decoder_sparse_step`
  == 0; the others are dense MLPs of `intermediate_size`. Experts have `moe_intermediate_size`; `norm_topk_prob`
  (default false) renormalises the top-k weights. Tensors `mlp.gate.weight` [E, H] and
  `mlp.experts.{e}.{gate,up,down}_proj.weight` (or the fused 3-D `mlp.experts.gate_up_proj` [E, 2I, H] and
  `mlp.experts.down_proj` [E, H, I]).
- Qwen2-MoE adds a shared expert of `shared_expert_intermediate_size` on every token, times
  sigmoid(`mlp.shared_expert_gate.weight` . x).
- Mixtral: every layer sparse, experts of `intermediate_size`, top-k always renormalised; tensors
  `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1` (gate) / `w3` (up) / `w2` (down).
The graph is octavo.export.moe_graph's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from octavo.errors import ModelFormatError, UnsupportedArchitectureError

# manifest architecture name -> checkpoint layout ("qwen": mlp.*; "mixtral": block_sparse_moe.*)
MOE_ARCHITECTURES: dict[str, str] = {"qwen3_moe": "qwen", "qwen2_moe": "qwen", "mixtral": "mixtral"}
MAX_EXPERTS = 1024  # more than any released model (DeepSeek-V3: 256); bounds what a config makes us allocate
EXPERT_NAMES = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The experts of a model's sparse layers."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[int, ...]  # the layers whose MLP is a MoE block; the others are dense MLPs
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0 = none
    layout: str = "qwen"  # checkpoint naming, MOE_ARCHITECTURES' value

    def prefix(self, layer: int) -> str:
        """The checkpoint prefix of LAYER's MoE block."""
        return f"model.layers.{layer}." + ("block_sparse_moe." if self.layout == "mixtral" else "mlp.")

    def router(self, layer: int) -> str:
        return self.prefix(layer) + "gate.weight"

    def expert(self, layer: int, expert: int, which: str) -> str:
        """The weight of EXPERT's projection WHICH ("gate", "up" or "down") in LAYER."""
        gate, up, down = EXPERT_NAMES[self.layout]
        return self.prefix(layer) + f"experts.{expert}.{dict(gate=gate, up=up, down=down)[which]}.weight"

    def describe(self, expert_weights: str = "float32") -> dict[str, Any]:
        """The manifest's record of the expert layout (Manifest.moe); EXPERT_WEIGHTS: "float32", or "gguf" where the
        graph multiplies the file's own blocks."""
        return {
            "num_experts": self.num_experts, "top_k": self.top_k,
            "expert_intermediate_size": self.expert_intermediate_size, "normalize_top_k": self.normalize_top_k,
            "sparse_layers": list(self.sparse_layers),
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "op": "octavo.MoE", "expert_weights": expert_weights,
        }


def _positive(config: dict[str, Any], *keys: str) -> int:
    """The first of KEYS the config has, a positive integer."""
    for key in keys:
        if key in config and config[key] is not None:
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelFormatError(f"config.json: {key!r} must be a positive integer, got {value!r}")
            return value
    raise ModelFormatError(f"config.json: {' or '.join(map(repr, keys))} is missing (a Mixture-of-Experts model needs it)")


def moe_from_config(config: dict[str, Any], architecture: str, num_layers: int) -> MoeSpec:
    """The MoeSpec of an MoE architecture's config; bad or unsupported values raise with what to fix."""
    layout = MOE_ARCHITECTURES[architecture]
    experts = _positive(config, "num_experts", "num_local_experts")
    if experts > MAX_EXPERTS:
        raise ModelFormatError(f"config.json: {experts} experts is more than octavo accepts ({MAX_EXPERTS})")
    top_k = _positive(config, "num_experts_per_tok")
    if top_k > experts:
        raise ModelFormatError(f"config.json: num_experts_per_tok {top_k} exceeds the {experts} experts")
    if layout == "mixtral":
        return MoeSpec(experts, top_k, _positive(config, "intermediate_size"), True, tuple(range(num_layers)),
                       layout=layout)
    step = _positive(config, "decoder_sparse_step") if config.get("decoder_sparse_step") is not None else 1
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ModelFormatError(f"config.json: mlp_only_layers must be a list of layer indices, got {dense!r}")
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if architecture == "qwen2_moe":
        shared = _positive(config, "shared_expert_intermediate_size")
    elif config.get("shared_expert_intermediate_size"):
        raise UnsupportedArchitectureError(f"{architecture}: a shared expert is not part of this architecture")
    return MoeSpec(experts, top_k, _positive(config, "moe_intermediate_size"), bool(config.get("norm_topk_prob", False)),
                   sparse, shared, layout)


def moe_sliding_windows(config: dict[str, Any], architecture: str, num_layers: int) -> list[int] | None:
    """Per-layer windows where an MoE architecture's rule differs from its dense sibling's (None: the usual rule).
    Qwen3-MoE: transformers keeps `sliding_window` on every layer when `use_sliding_window`, else none. Qwen2-MoE
    without `layer_types` (transformers 4 files): transformers 5's default pattern, the window on even layers below
    `max_window_layers`."""
    window = config.get("sliding_window")
    if architecture == "qwen3_moe":
        return [int(window) if window and config.get("use_sliding_window") else 0] * num_layers
    if architecture == "qwen2_moe" and config.get("layer_types") is None:
        if not (window and config.get("use_sliding_window")):
            return [0] * num_layers
        first = int(config.get("max_window_layers", 28))
        return [int(window) if (i + 1) % 2 and i < first else 0 for i in range(num_layers)]
    return None


def moe_not_on_tensorrt(subject: str) -> str:
    """The one wording of "a Mixture-of-Experts export does not run on TensorRT" (engine arguments, the builder)."""
    return (f"{subject} is a Mixture-of-Experts model: its octavo.MoE nodes run on ONNX Runtime only (the op has no "
            "TensorRT plugin yet); serve it with the onnxruntime backend")
