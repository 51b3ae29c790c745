"""Mixture-of-Experts GGUF files (llama.cpp's layout) in HF terms, for the reader (octavo.export.gguf_reader) and
octavo's writer (octavo.export.gguf_writer).

llama.cpp facts relied on: `general.architecture` `qwen3moe` / `qwen2moe`, or `llama` with `llama.expert_count` > 0
(Mixtral); metadata `<arch>.expert_count`, `.expert_used_count`, `.expert_feed_forward_length` (the expert width;
Mixtral's is `feed_forward_length`), `.expert_shared_feed_forward_length` (qwen2moe) and, where present,
`.expert_weights_norm`; otherwise the top-k weights are renormalised as llama.cpp does per architecture (qwen3moe
and Mixtral yes, qwen2moe no). Per sparse layer: `blk.N.ffn_gate_inp` (router [E, H], kept F32 by llama-quantize),
the experts as 3-D tensors `blk.N.ffn_{gate,up}_exps` [E, I, H] and `ffn_down_exps` [E, H, I] (numpy order), and
qwen2moe's shared expert `ffn_{gate,up,down}_shexp` plus its gate `ffn_gate_inp_shexp` [H]. A layer without
`ffn_gate_inp` is dense (mlp_only_layers). The 3-D tensors are named `<moe prefix>experts.{gate,up,down}_proj.weight`
on the HF side (octavo.export.moe_graph reads them; their blocks are 2-D: experts' rows one after another).
Files that store each expert as its own tensor (old Mixtral conversions, `blk.N.ffn_gate.E.weight`) are refused.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from octavo.errors import ModelFormatError
from octavo.export.moe_spec import MAX_EXPERTS

# GGUF architecture -> (HF model_type, HF architectures entry), for the MoE-only architectures
MOE_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}
MIXTRAL = ("mixtral", "MixtralForCausalLM")  # a llama-architecture file with experts
# llama.cpp's per-layer MoE tensor -> its HF name after the layer's MoE prefix (mlp. / block_sparse_moe.)
MOE_TENSORS: dict[str, str] = {
    "ffn_gate_inp": "gate", "ffn_gate_exps": "experts.gate_proj", "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj", "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj", "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}
_LEGACY_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
_RENORMALISED = {"qwen3moe": True, "qwen2moe": False, "llama": True}  # llama.cpp's norm_w per architecture


def moe_architecture(meta: dict[str, Any], arch: str) -> tuple[str, str] | None:
    """(HF model_type, HF architecture) of an MoE file, or None for a dense one."""
    if arch in MOE_GGUF_ARCHITECTURES:
        return MOE_GGUF_ARCHITECTURES[arch]
    if arch == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        return MIXTRAL
    return None


def moe_prefix(model_type: str) -> str:
    return "block_sparse_moe." if model_type == "mixtral" else "mlp."


def moe_config(meta: dict[str, Any], arch: str, tensor_names: set[str], num_layers: int,
               path: Path) -> dict[str, Any]:
    """The HF config entries of an MoE file (incl. model_type / architectures); ModelFormatError on bad metadata."""
    model_type, hf_arch = moe_architecture(meta, arch) or MIXTRAL

    def count(key: str) -> int:
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
            raise ModelFormatError(f"{path.name}: GGUF metadata {arch}.{key} must be a positive integer, got {value!r}")
        return int(value)

    experts, used = count("expert_count"), count("expert_used_count")
    if experts > MAX_EXPERTS or used > experts:
        raise ModelFormatError(f"{path.name}: {arch}.expert_count {experts} / expert_used_count {used} are not a valid "
                               f"expert layout (at most {MAX_EXPERTS} experts, used <= count)")
    legacy = sorted(n for n in tensor_names if _LEGACY_EXPERT.fullmatch(n))
    if legacy:
        raise ModelFormatError(f"{path.name}: {legacy[0]!r} stores one expert per tensor (an old conversion); "
                               "convert the model again with a current llama.cpp (3-D ffn_*_exps tensors)")
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
    norm = meta.get(f"{arch}.expert_weights_norm")
    config: dict[str, Any] = {
        "model_type": model_type, "architectures": [hf_arch], "num_experts": experts, "num_local_experts": experts,
        "num_experts_per_tok": used, "mlp_only_layers": [i for i in range(num_layers) if i not in sparse],
        "norm_topk_prob": bool(norm) if norm is not None else _RENORMALISED[arch],
    }
    if model_type == "mixtral":
        if config["mlp_only_layers"]:
            raise ModelFormatError(f"{path.name}: a Mixtral file needs ffn_gate_inp in every layer; "
                                   f"layer {config['mlp_only_layers'][0]} has none")
        if not config["norm_topk_prob"]:
            raise ModelFormatError(f"{path.name}: Mixtral renormalises its top-k weights; expert_weights_norm is false")
        return config
    config["moe_intermediate_size"] = count("expert_feed_forward_length")
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = count("expert_shared_feed_forward_length")
    if model_type == "qwen3_moe" and meta.get(f"{arch}.attention.sliding_window"):
        config["use_sliding_window"] = True  # one window for every layer, as the metadata states it
    return config


def moe_expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every MoE tensor the config implies (checked before anything is dequantized)."""
    h, experts = config["hidden_size"], config["num_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    dense = set(config.get("mlp_only_layers") or [])
    shared = config.get("shared_expert_intermediate_size") or 0
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(config["num_hidden_layers"]):
        if i in dense:
            continue
        p = f"model.layers.{i}.{moe_prefix(config['model_type'])}"
        expected |= {p + "gate.weight": (experts, h), p + "experts.gate_proj.weight": (experts, inter, h),
                     p + "experts.up_proj.weight": (experts, inter, h), p + "experts.down_proj.weight": (experts, h, inter)}
        if shared:
            expected |= {p + "shared_expert.gate_proj.weight": (shared, h), p + "shared_expert.up_proj.weight": (shared, h),
                         p + "shared_expert.down_proj.weight": (h, shared), p + "shared_expert_gate.weight": (h,)}
    return expected


# ----------------------------------------------------------------------------- writing (octavo's GGUF writer)
def moe_gguf_arch(config: dict[str, Any]) -> str | None:
    """The GGUF architecture an HF MoE config is written as, or None for a dense config."""
    return {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}.get(config.get("model_type", ""))


def write_moe_metadata(writer: Any, config: dict[str, Any]) -> None:
    experts = config.get("num_experts") or config["num_local_experts"]
    writer.add_expert_count(int(experts))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if config["model_type"] != "mixtral":
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", False)))
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


def moe_gguf_tensors(weights: dict[str, np.ndarray], config: dict[str, Any]) -> tuple[dict[str, np.ndarray], set[str]]:
    """(llama.cpp name -> array of every MoE tensor: experts stacked 3-D, the shared gate 1-D; the HF names used)."""
    from octavo.export.moe_spec import EXPERT_NAMES

    layout = "mixtral" if config["model_type"] == "mixtral" else "qwen"
    experts = config.get("num_experts") or config["num_local_experts"]
    by_suffix = {hf: gg for gg, hf in MOE_TENSORS.items()}
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.{moe_prefix(config['model_type'])}"
        if p + "gate.weight" not in weights:
            continue
        for which, name in zip(("gate_proj", "up_proj", "down_proj"), EXPERT_NAMES[layout]):
            parts = [p + f"experts.{e}.{name}.weight" for e in range(experts)]
            out[f"blk.{i}.{by_suffix['experts.' + which]}.weight"] = np.stack([weights[n] for n in parts])
            used.update(parts)
        for suffix, gguf_name in by_suffix.items():
            if suffix.startswith("experts."):
                continue
            name = p + suffix + ".weight"
            if name in weights:
                value = np.asarray(weights[name], np.float32)
                out[f"blk.{i}.{gguf_name}.weight"] = value.reshape(-1) if suffix == "shared_expert_gate" else value
                used.add(name)
    return out, used
