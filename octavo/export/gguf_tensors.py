"""The tensors of a GGUF file as a lazy mapping of HF names -> float32 numpy arrays in HF layout.

GGUF facts this module relies on (llama.cpp's converter and the `gguf` package):
- names: `token_embd.weight`, `output_norm.weight`, `output.weight`, `blk.{i}.attn_q|attn_k|attn_v|
  attn_output|ffn_gate|ffn_up|ffn_down|attn_norm|ffn_norm.weight` (+ `.bias` on attn_q/k/v for qwen2;
  + `blk.{i}.attn_q_norm|attn_k_norm.weight`, qwen3's per-head q/k RMSNorm);
- phi3 files store attention as ONE fused `blk.{i}.attn_qkv.weight` (q, k, v rows back to back, HF's
  `self_attn.qkv_proj`) and `blk.{i}.ffn_up.weight` holds gate and up fused (HF's `mlp.gate_up_proj`,
  gate rows first; llama.cpp's SwiGLU takes the first half as the gate); there is no ffn_gate. The
  Checkpoint presents both as the separate q/k/v and gate/up tensors. 128k phi3 files add
  `rope_factors_long/short.weight` (longrope: read into the config by gguf_rope);
- gemma2 / gemma3 files name their sandwich norms differently and store every norm weight plus 1
  (octavo.export.gguf_gemma): GEMMA_NAMES below, and the 1 is subtracted on lookup;
- GGUF lists dimensions innermost first, so a HF Linear weight [out, in] is stored with shape (in, out);
  `gguf.GGUFReader` already gives `tensor.data` in numpy order (rows = out), quantised rows as bytes;
- for llama-arch models llama.cpp permutes the rows of q_proj / k_proj (weight and bias) per head from
  HF's rotate-half RoPE layout to the interleaved (GPT-J) layout: HF row (head, half, i) is stored at
  (head, i, half). `unpermute_qk` undoes that. qwen2, qwen3 and phi3 files are stored unpermuted (NeoX
  RoPE in llama.cpp; its converter permutes only llama-arch q/k).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from octavo.errors import ModelFormatError
from octavo.export.gguf_gemma import BLOCK_NAMES as GEMMA_BLOCK_NAMES
from octavo.export.gguf_gemma import NORM_OFFSET, is_gemma_norm
from octavo.export.gguf_moe import MOE_TENSORS

if TYPE_CHECKING:
    from octavo.export.gguf_blocks import Blocks

# GGML types this reader dequantizes (all through gguf.quants.dequantize); each is tested against an
# independent dequantizer or a quantize round trip in tests/test_gguf.py.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3: per-head RMSNorm weights, [head_dim]
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v fused
}
# phi3: ffn_up is gate and up fused (there is no ffn_gate)
_FUSED_GATE_UP_NAMES = _BLOCK_NAMES | {"ffn_up": "mlp.gate_up_proj"}
_GEMMA_NAMES = _BLOCK_NAMES | GEMMA_BLOCK_NAMES
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# Tensors a GGUF may carry that have no HF tensor (their content goes into the config instead).
NON_HF_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(gguf_name: str, *, fused_gate_up: bool = False, gemma: bool = False,
            moe_prefix: str | None = None) -> str | None:
    """The HF state-dict name of a GGUF tensor name, or None when it has none. FUSED_GATE_UP: the file's
    ffn_up holds gate and up (phi3), named mlp.gate_up_proj; GEMMA: a gemma2 / gemma3 file's norm names.
    MOE_PREFIX: the file has experts (octavo.export.gguf_moe), named under that prefix of their layer
    (mlp. / block_sparse_moe.)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = _GEMMA_NAMES if gemma else _FUSED_GATE_UP_NAMES if fused_gate_up else _BLOCK_NAMES
    match = _BLOCK_RE.fullmatch(gguf_name)
    if moe_prefix is not None and match is not None and match.group(2) in MOE_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{moe_prefix}{MOE_TENSORS[part]}.{kind}"
    if match is None or match.group(2) not in block_names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{block_names[part]}.{kind}"


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF (rotate-half) rows -> llama.cpp (interleaved) rows, as llama.cpp's converter does."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_qk`: llama.cpp (interleaved) rows -> HF (rotate-half) rows."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ModelFormatError(f"q/k tensor with {rows} rows cannot be split into {n_head} heads of even size")
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize(tensor: object, name: str) -> np.ndarray:
    """A `gguf.ReaderTensor` as a new float32 array in numpy order (outermost dimension first)."""
    from gguf import quants

    type_name = tensor.tensor_type.name  # type: ignore[attr-defined]
    if type_name not in SUPPORTED_TYPES:
        raise ModelFormatError(
            f"GGUF tensor {name!r} has type {type_name}, which octavo does not read; supported types: "
            f"{', '.join(SUPPORTED_TYPES)}. Re-quantize the model to one of them (e.g. llama-quantize ... Q8_0)."
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # type: ignore[attr-defined]
    try:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # type: ignore[attr-defined]
        return np.array(values, dtype=np.float32, copy=True).reshape(shape)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise ModelFormatError(f"GGUF tensor {name!r} ({type_name}, shape {shape}) cannot be decoded: {exc}") from exc


@dataclass(slots=True, eq=False)
class GGUFTensors(Mapping[str, np.ndarray]):
    """HF name -> float32 array, dequantized (and un-permuted) each time it is looked up; nothing cached."""

    reader: object  # gguf.GGUFReader (memory-maps the file)
    by_hf_name: dict[str, object]  # HF name -> gguf.ReaderTensor
    gguf_names: dict[str, str]  # HF name -> GGUF name
    num_heads: int
    num_kv_heads: int
    permuted_qk: bool  # True for llama-arch files (llama.cpp permuted q/k rows)
    norm_offset: float = 0.0  # subtracted from every RMSNorm weight (Gemma files store w + 1)

    def __getitem__(self, key: str) -> np.ndarray:
        tensor = self.by_hf_name[key]  # KeyError for unknown names, as a Mapping should
        values = dequantize(tensor, self.gguf_names[key])
        if self.norm_offset and is_gemma_norm(key):
            values -= np.float32(self.norm_offset)
        if self.permuted_qk and ".self_attn.q_proj." in key:
            values = unpermute_qk(values, self.num_heads)
        elif self.permuted_qk and ".self_attn.k_proj." in key:
            values = unpermute_qk(values, self.num_kv_heads)
        return values

    def blocks(self, key: str) -> "Blocks | None":
        """The tensor's own quantized blocks in MatMulNBits' layout (un-permuted like __getitem__), or
        None when its type has no exact layout there (float types, Q2_K, Q3_K, IQ4_*): gguf_blocks."""
        from octavo.export.gguf_blocks import parse_blocks

        tensor = self.by_hf_name[key]
        shape = self.shape(key)
        if len(shape) == 3:  # an MoE file's experts [E, N, K]: their rows one after another, [E * N, K]
            shape = (shape[0] * shape[1], shape[2])
        if len(shape) != 2:
            return None
        raw = np.asarray(tensor.data)  # type: ignore[attr-defined]
        try:
            blocks = parse_blocks(tensor.tensor_type.name, raw.reshape(shape[0], -1), *shape)  # type: ignore[attr-defined]
        except ValueError as exc:
            raise ModelFormatError(f"GGUF tensor {self.gguf_names[key]!r}: {exc}") from exc
        if blocks is not None and self.permuted_qk and (".self_attn.q_proj." in key or ".self_attn.k_proj." in key):
            heads = self.num_heads if ".q_proj." in key else self.num_kv_heads
            blocks = blocks.rows(unpermute_qk(np.arange(shape[0]), heads))
        return blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_hf_name)

    def __len__(self) -> int:
        return len(self.by_hf_name)

    def shape(self, key: str) -> tuple[int, ...]:
        """The HF (numpy-order) shape of a tensor without dequantizing it."""
        return tuple(int(d) for d in reversed(self.by_hf_name[key].shape.tolist()))  # type: ignore[attr-defined]


def index_tensors(reader: object, *, num_heads: int, num_kv_heads: int, permuted_qk: bool,
                  fused_gate_up: bool = False, gemma: bool = False, moe_prefix: str | None = None) -> GGUFTensors:
    """Map every GGUF tensor of the file to its HF name; refuse unknown names and unreadable types.
    FUSED_GATE_UP: ffn_up is phi3's fused gate/up tensor; GEMMA: gemma2 / gemma3 names and norms; MOE_PREFIX:
    see hf_name."""
    by_hf: dict[str, object] = {}
    names: dict[str, str] = {}
    for tensor in reader.tensors:  # type: ignore[attr-defined]
        name = str(tensor.name)
        if name in NON_HF_TENSORS:
            continue
        target = hf_name(name, fused_gate_up=fused_gate_up, gemma=gemma, moe_prefix=moe_prefix)
        if target is None:
            raise ModelFormatError(
                f"GGUF tensor {name!r} has no counterpart in a Llama-family HF checkpoint; "
                "this file is not a plain llama/mistral/qwen2/qwen3/phi3/smollm3/gemma2/gemma3 model"
            )
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise ModelFormatError(
                f"GGUF tensor {name!r} has type {tensor.tensor_type.name}, which octavo does not read; "
                f"supported types: {', '.join(SUPPORTED_TYPES)}"
            )
        by_hf[target] = tensor
        names[target] = name
    return GGUFTensors(reader, by_hf, names, num_heads, num_kv_heads, permuted_qk,
                       NORM_OFFSET if gemma else 0.0)
