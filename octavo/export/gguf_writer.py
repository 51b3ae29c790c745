"""Write a HF Llama-family checkpoint folder as a GGUF file the way llama.cpp's converter lays it out.

Used to make small GGUF files for tests (tiny random models, any supported tensor type) and as the
other half of the GGUF round trip: q/k rows of llama-arch models are permuted into llama.cpp's
interleaved RoPE layout, dimensions are stored innermost first, the tokenizer goes into tokenizer.ggml.*.

    write_gguf(hf_dir, "tiny.gguf", tensor_type="Q8_0")
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from octavo.errors import ModelFormatError, UnsupportedArchitectureError
from octavo.export.checkpoint import ModelSpec, spec_from_config
from octavo.export.gguf_gemma import BLOCK_NAMES as GEMMA_BLOCK_NAMES
from octavo.export.gguf_gemma import DEFAULT_PATTERN, LOCAL_ROPE_BASE, NORM_OFFSET, is_gemma_norm, layer_types
from octavo.export.gguf_gemma import query_pre_attn_scalar
from octavo.export.gguf_moe import moe_gguf_arch, moe_gguf_tensors, write_moe_metadata
from octavo.export.gguf_rope import llama3_divisors
from octavo.export.gguf_tensors import permute_qk
from octavo.export.gguf_tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED

_ARCH_BY_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                       "smollm3": "smollm3", "gemma2": "gemma2", "gemma3_text": "gemma3"}
_PERMUTED_ARCHS = ("llama", "smollm3")  # llama.cpp's converter permutes their q/k rows
_BLOCK_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3's fused tensors, written as they are
}


_GEMMA_PARTS = _BLOCK_PARTS | {hf: part for part, hf in GEMMA_BLOCK_NAMES.items()}


def gguf_tensor_name(hf: str, gemma: bool = False) -> str:
    """HF state-dict name -> llama.cpp tensor name (GEMMA: a gemma2 / gemma3 file's norm names)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    middle = ".".join(parts[3:-1])
    names = _GEMMA_PARTS if gemma else _BLOCK_PARTS
    if parts[:2] != ["model", "layers"] or middle not in names:
        raise ModelFormatError(f"tensor {hf!r} has no GGUF name")
    return f"blk.{parts[2]}.{names[middle]}.{parts[-1]}"


def write_gguf(hf_dir: str | Path, out: str | Path, *, tensor_type: str = "F32", arch: str | None = None,
               name: str | None = None, tokenizer_pre: str = "default", add_bos_token: bool | None = None,
               tensor_types: Mapping[str, str] | None = None) -> Path:
    """Write HF_DIR (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) to OUT.

    tensor_type: F32, F16, Q8_0, Q4_0 or Q4_1 for 2-D weights (norms and biases stay F32, as llama.cpp
    keeps them); arch: the GGUF general.architecture to write (default: llama for llama/mistral configs,
    qwen2 for qwen2, qwen3 for qwen3: q_norm / k_norm become blk.N.attn_q_norm / attn_k_norm; phi3 for
    phi3: qkv_proj / gate_up_proj become blk.N.attn_qkv / ffn_up, unpermuted, the window on every layer,
    longrope as rope_factors_long/short tensors, partial rotary as rope.dimension_count; smollm3: q/k permuted;
    gemma2 / gemma3: norms stored plus 1 under llama.cpp's names, the keys of octavo.export.gguf_gemma);
    tokenizer_pre: tokenizer.ggml.pre to write; add_bos_token: overrides
    tokenizer_config.json's add_bos_token; tensor_types: {suffix: type}, 2-D tensors whose GGUF name ends in a
    suffix ("attn_v.weight") get that type instead (a mix such as llama.cpp's Q4_K_M keeps)."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = arch or _ARCH_BY_MODEL_TYPE.get(config.get("model_type", "")) or moe_gguf_arch(config)
    if arch is None:
        raise UnsupportedArchitectureError(f"cannot write model_type {config.get('model_type')!r} as GGUF")
    weights = load_file(str(hf_dir / "model.safetensors"))
    qtype = gguf.GGMLQuantizationType[tensor_type]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    spec = spec_from_config(config)  # refuses what octavo cannot read back before anything is written
    theta = spec.rope_theta
    gemma = arch in DEFAULT_PATTERN
    qwen3_window = _qwen3_window(config) if arch == "qwen3" else 0
    if arch == "smollm3" and spec.nope_layers != [i for i in range(spec.num_layers) if (i + 1) % 4 == 0]:
        raise ModelFormatError("llama.cpp's smollm3 leaves out rope on every 4th layer and stores no layer list; "
                               f"this model's NoPE layers are {spec.nope_layers}")

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or hf_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(spec.rotary_size)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window") and config.get("model_type") in ("mistral", "mixtral"):
        writer.add_sliding_window(int(config["sliding_window"]))
    if qwen3_window:
        writer.add_sliding_window(qwen3_window)
    if arch == "phi3":  # as llama.cpp's converter: the window (0 = none) and the original context
        writer.add_sliding_window(int(config.get("sliding_window") or 0))
        if config.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(config["original_max_position_embeddings"]))
    if moe_gguf_arch(config):  # experts: llama.cpp's 3-D ffn_*_exps tensors (octavo.export.gguf_moe)
        write_moe_metadata(writer, config)
    if gemma:
        _write_gemma(writer, arch, spec, config)
    else:
        _write_rope_scaling(writer, config, spec, theta)
    _write_tokenizer(writer, hf_dir, config, tokenizer_pre, add_bos_token)

    permuted = arch in _PERMUTED_ARCHS
    moe_tensors, moe_used = moe_gguf_tensors(weights, config) if moe_gguf_arch(config) else ({}, set())
    for gguf_name, data in moe_tensors.items():  # the router and the shared expert's gate stay F32, as llama.cpp
        router = gguf_name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        _add_tensor(writer, gguf_name, data, gguf.GGMLQuantizationType.F32 if router else qtype)
    for hf, tensor in weights.items():
        if hf in moe_used or hf == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        data = np.asarray(tensor, dtype=np.float32)
        if gemma and is_gemma_norm(hf):
            data = data + np.float32(NORM_OFFSET)  # llama.cpp's converter stores Gemma's 1 + w
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            data = permute_qk(data, heads if ".q_proj." in hf else kv_heads)
        gguf_name = gguf_tensor_name(hf, gemma)
        wanted = next((t for suffix, t in (tensor_types or {}).items() if gguf_name.endswith(suffix)), None)
        own = gguf.GGMLQuantizationType[wanted] if wanted else qtype
        _add_tensor(writer, gguf_name, data, own if data.ndim == 2 else gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _qwen3_window(config: dict[str, Any]) -> int:
    """The sliding window to write (0: none). GGUF has one window for all layers: a model whose layers
    differ (max_window_layers / layer_types) cannot be stored faithfully and is refused."""
    windows = set(spec_from_config(config).sliding_windows)
    if windows == {0}:
        return 0
    if len(windows) > 1:
        raise ModelFormatError(
            "this qwen3 model slides its attention window on some layers only (max_window_layers / layer_types); "
            "GGUF stores one window for all layers, so it cannot be written faithfully. Export the HF folder "
            "directly with `octavo export`"
        )
    return windows.pop()


def _write_gemma(writer: Any, arch: str, spec: ModelSpec, config: dict[str, Any]) -> None:
    """Gemma's keys as llama.cpp's converter writes them (octavo.export.gguf_gemma); what llama.cpp fixes
    instead of storing (the attention scale) must match, the layer pattern and local base are written only
    where they differ from llama.cpp's defaults (its sliding_window_pattern / rope.freq_base_swa keys)."""
    import gguf

    windows = {w for w in spec.sliding_windows if w}
    writer.add_sliding_window(windows.pop() if windows else 0)
    want = query_pre_attn_scalar({}, arch, dict(config, head_dim=spec.head_dim))
    if spec.query_scale is not None and abs(spec.query_scale - want ** -0.5) > 1e-12:
        raise ModelFormatError(f"llama.cpp derives a {arch} model's query_pre_attn_scalar ({want:g} here) and stores "
                               f"none; this model's is {spec.query_scale ** -2:g}")
    if arch == "gemma2" and spec.attn_softcap:
        writer.add_attn_logit_softcapping(spec.attn_softcap)
    if spec.final_softcap:
        writer.add_final_logit_softcapping(spec.final_softcap)
    types = ["sliding_attention" if w else "full_attention" for w in spec.sliding_windows]
    if types != layer_types({}, arch, spec.num_layers, "default"):
        writer.add_array(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch),
                         [t == "sliding_attention" for t in types])
    if arch == "gemma3" and spec.local_rope_theta not in (None, LOCAL_ROPE_BASE):
        writer.add_float32(gguf.Keys.Rope.FREQ_BASE_SWA.format(arch=arch), float(spec.local_rope_theta))
    if spec.rope_scaling is not None:  # Gemma 3's global layers: linear only (llama.cpp's converter)
        if spec.rope_scaling["rope_type"] != "linear" or spec.local_rope_scaling is not None:
            raise ModelFormatError(f"{arch} rope scaling {spec.rope_scaling} cannot be written to GGUF")
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(spec.rope_scaling["factor"]))


def _write_rope_scaling(writer: Any, config: dict[str, Any], spec: ModelSpec, theta: float) -> None:
    """linear / yarn as metadata; llama3 as the rope_freqs.weight divisors tensor, longrope as the
    rope_factors_long/short tensors with the attention factor (llama.cpp's way)."""
    import gguf

    head_dim = spec.rotary_size
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return
    if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "longrope":
        done = spec.rope_scaling
        writer.add_rope_scaling_attn_factors(float(done["attention_factor"]))
        if not config.get("original_max_position_embeddings"):  # the phi3 branch wrote a top-level one
            writer.add_rope_scaling_orig_ctx_len(int(done["original_max_position_embeddings"]))
        writer.add_tensor("rope_factors_long.weight", np.asarray(done["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(done["short_factor"], np.float32))
        return
    if kind == "llama3":
        divisors = llama3_divisors(head_dim, theta, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                                   scaling["original_max_position_embeddings"])
        writer.add_tensor("rope_freqs.weight", divisors.astype(np.float32))
    elif kind in ("linear", "yarn"):
        if kind == "yarn":
            _check_yarn_fits_gguf(scaling)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        original = config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        if original:  # transformers reads a top-level original_max_position_embeddings first
            writer.add_rope_scaling_orig_ctx_len(int(original))
        if kind == "yarn" and "beta_fast" in scaling:
            writer.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        if kind == "yarn" and "beta_slow" in scaling:
            writer.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))
    else:
        raise ModelFormatError(f"rope scaling {kind!r} cannot be written to GGUF")


def _check_yarn_fits_gguf(scaling: dict[str, Any]) -> None:
    """GGUF (llama.cpp) stores yarn's factor, original context and betas; it always truncates the
    correction range and derives the attention factor from the factor. Anything else would read back as
    a different model: refused."""
    extra = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if scaling.get(k) not in (None,)]
    if scaling.get("truncate", True) is False:
        extra.append("truncate=False")
    if extra:
        raise ModelFormatError(
            f"yarn rope scaling with {', '.join(extra)} cannot be written to GGUF faithfully (llama.cpp's keys hold "
            "only the factor, the original context and beta_fast/beta_slow); export the HF folder with `octavo export`")


def _add_tensor(writer: Any, name: str, data: np.ndarray, qtype: Any) -> None:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data))
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _write_tokenizer(writer: Any, hf_dir: Path, config: dict[str, Any], pre: str, add_bos: bool | None) -> None:
    """tokenizer.json (BPE) -> tokenizer.ggml.*: byte_fallback vocabularies as SentencePiece ("llama",
    scores = -id, no merges, like llama.cpp's SentencePiece files), others as byte-level ("gpt2")."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg_path = hf_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ModelFormatError(f"only BPE tokenizers can be written to GGUF, not {model.get('type')!r}")
    vocab: dict[str, int] = dict(model["vocab"])
    for added in tok.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    user = {a["content"] for a in tok.get("added_tokens", []) if not a.get("special")}
    unk = model.get("unk_token")
    sentencepiece = bool(model.get("byte_fallback"))

    def kind(t: str) -> int:
        if t == unk:
            return UNKNOWN
        if t in special:
            return CONTROL
        if t in user:
            return USER_DEFINED
        if sentencepiece and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            return BYTE
        return NORMAL

    types = [kind(t) for t in tokens]
    if sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([float(-i) if k == NORMAL else 0.0 for i, k in enumerate(types)])
        writer.add_add_space_prefix(True)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        writer.add_token_merges(merges)
    writer.add_token_types(types)
    for key, setter in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                        ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            setter(int(value))
    if unk is not None and unk in vocab:
        writer.add_unk_token_id(vocab[unk])
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token", sentencepiece) if add_bos is None else add_bos))
    if tok_cfg.get("chat_template"):
        writer.add_chat_template(tok_cfg["chat_template"])
